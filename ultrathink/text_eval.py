"""Score a text under a model named by a directory or an MLflow URI, with the one yardstick (ultrathink.scoring).

A model is named by either
  - a directory: a model dir (config.json + model.safetensors) whose tokenizer is the sibling `tokenizer/` dir (the
    pipeline's artifacts/model + artifacts/tokenizer layout), or a directory holding `model/` and `tokenizer/`;
  - an MLflow model URI (`models:/ultrathink@champion`, `models:/ultrathink/3`, `runs:/...`): the logged pyfunc's
    `model` and `tokenizer` artifacts, and the `ultrathink` package snapshot logged with it.

A registered model is scored under its own code: a separate Python process puts the model's package snapshot first
on its path, so an edit of the model's math since it was registered (a sign in the rotary embedding, say) does not
change its score. Only the arithmetic of the yardstick (ultrathink/scoring.py, which imports nothing else of the
package) is today's, loaded by path.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from ultrathink import scoring
from ultrathink.data.sources import split_documents
from ultrathink.errors import StageError
from ultrathink.model import UltraThink
from ultrathink.model.model import CONFIG_FILE
from ultrathink.scoring import TextScore
from ultrathink.tokenizer import load_tokenizer


class ModelNotFoundError(StageError):
    """The --model argument names no model directory or MLflow model; the message says what was looked for."""


@dataclass
class ModelFiles:
    model_dir: Path  # config.json + model.safetensors
    tokenizer_dir: Path
    code_dir: Path | None = None  # the package snapshot logged with a registered model (holds `ultrathink/`)


def is_mlflow_uri(ref: str) -> bool:
    return "://" in ref or ref.startswith(("models:/", "runs:/"))


def resolve_model(ref: str, root: Path = Path(".")) -> tuple[Path, Path]:
    """(model dir, tokenizer dir) for a directory or an MLflow model URI (downloaded from the project's store)."""
    files = resolve_model_files(ref, root)
    return files.model_dir, files.tokenizer_dir


def resolve_model_files(ref: str, root: Path = Path(".")) -> ModelFiles:
    if is_mlflow_uri(ref):
        return _from_mlflow(ref, root)
    path = Path(ref)
    for model_dir, tokenizer_dir in ((path, path.parent / "tokenizer"), (path / "model", path / "tokenizer"),
                                     (path / "artifacts" / "model", path / "artifacts" / "tokenizer")):
        if (model_dir / CONFIG_FILE).is_file() and (tokenizer_dir / "tokenizer.json").is_file():
            return ModelFiles(model_dir, tokenizer_dir)
    raise ModelNotFoundError(
        f"{ref}: not a model: expected a model dir ({CONFIG_FILE} + model.safetensors) with a sibling tokenizer/ "
        "dir (artifacts/model), a dir holding model/ and tokenizer/, or an MLflow URI such as models:/ultrathink@champion")


def _from_mlflow(uri: str, root: Path) -> ModelFiles:
    """Download the pyfunc model's files (to MLflow's temp dir) and point at its artifacts and code snapshot."""
    import mlflow
    from mlflow.exceptions import MlflowException

    from ultrathink.registry.tracking import use_tracking

    store = use_tracking(root)
    try:
        local = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri))
    except MlflowException as exc:
        raise ModelNotFoundError(f"{uri}: cannot be loaded from the MLflow store {store}: {exc.message}") from None
    # The pyfunc's MLmodel maps each artifact key to where MLflow stored it (named after the logged folder).
    mlmodel = yaml.safe_load((local / "MLmodel").read_text()) if (local / "MLmodel").is_file() else {}
    flavor = mlmodel.get("flavors", {}).get("python_function", {}) or {}
    artifacts = flavor.get("artifacts") or {}
    if "model" not in artifacts or "tokenizer" not in artifacts:
        raise ModelNotFoundError(f"{uri}: not an UltraThink model (its MLmodel names no model and tokenizer artifacts)")
    code = local / flavor["code"] if flavor.get("code") else None
    return ModelFiles(local / artifacts["model"]["path"], local / artifacts["tokenizer"]["path"],
                      code if code is not None and (code / "ultrathink").is_dir() else None)


_SNAPSHOT_SCORER = """
import importlib.util, json, sys
code_dir, scoring_file, model_dir, tokenizer_dir, documents_file, function = sys.argv[1:7]
sys.path.insert(0, code_dir)
from ultrathink.model import UltraThink  # the model's own code
assert UltraThink.__module__.startswith("ultrathink.") and sys.modules["ultrathink"].__file__.startswith(code_dir)
spec = importlib.util.spec_from_file_location("ultrathink_yardstick", scoring_file)
scoring = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
spec.loader.exec_module(scoring)
from transformers import AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
with open(documents_file, encoding="utf-8") as f:
    documents = [json.loads(line)["item"] for line in f if line.strip()]
score = getattr(scoring, function)(UltraThink.from_pretrained(model_dir), tokenizer, documents)
print(json.dumps(score.to_dict()))
"""


def score_model(files: ModelFiles, documents, chats: bool = False) -> TextScore:
    """Bits per byte of `documents` under a model and its own tokenizer, and under its own code when it has a
    snapshot (a registered model), else under this process's code (a model dir of this project). `chats`: the
    documents are chats (messages lists), scored on their answers only (scoring.score_conversations)."""
    function = "score_conversations" if chats else "score_documents"
    if files.code_dir is None:
        return getattr(scoring, function)(UltraThink.from_pretrained(files.model_dir),
                                          load_tokenizer(files.tokenizer_dir), documents)
    with tempfile.TemporaryDirectory(prefix="ultrathink-score-") as tmp:
        documents_file = Path(tmp) / "documents.jsonl"
        documents_file.write_text("".join(json.dumps({"item": d}) + "\n" for d in documents), encoding="utf-8")
        args = [sys.executable, "-c", _SNAPSHOT_SCORER, str(files.code_dir.resolve()), scoring.__file__,
                str(files.model_dir.resolve()), str(files.tokenizer_dir.resolve()), str(documents_file), function]
        # Run from the temp dir so the project's own `ultrathink/` (the cwd) cannot shadow the snapshot.
        done = subprocess.run(args, cwd=tmp, capture_output=True, text=True)
    if done.returncode:
        raise StageError(f"scoring {files.model_dir} under its own code failed: {done.stderr.strip()[-800:]}")
    return TextScore(**json.loads(done.stdout.strip().splitlines()[-1]))


def evaluate_text_file(model_ref: str, text_file: Path, unit: str = "paragraph", root: Path = Path(".")) -> TextScore:
    """`ultrathink eval`: score the UTF-8 text of `text_file` under the model named by `model_ref`, split into
    documents as the data loader splits a .txt source (`unit`: paragraph, line or file; data.txt_unit)."""
    text_file = Path(text_file)
    if not text_file.is_file():
        raise StageError(f"text file not found: {text_file}")
    try:
        text = text_file.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise StageError(f"{text_file}: not valid UTF-8 at byte {exc.start}: {exc.reason}") from None
    documents = split_documents(text, unit)
    if not documents:
        raise StageError(f"{text_file}: no text: there is nothing to score")
    return score_model(resolve_model_files(model_ref, root), documents)
