"""Score any text file under a trained model (`ultrathink eval`) with the one yardstick of ultrathink.evaluate.

A model is named by either
  - a directory: a model dir (config.json + model.safetensors) whose tokenizer is the sibling `tokenizer/` dir (the
    pipeline's artifacts/model + artifacts/tokenizer layout), or a directory holding `model/` and `tokenizer/`;
  - an MLflow model URI (`models:/ultrathink@champion`, `runs:/...`): the logged pyfunc's artifacts hold the same
    `model` and `tokenizer` directories (see ultrathink/registry/promote.py).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from ultrathink.data.sources import split_documents
from ultrathink.errors import StageError
from ultrathink.evaluate import TextScore, score_documents
from ultrathink.model import UltraThink
from ultrathink.model.model import CONFIG_FILE
from ultrathink.tokenizer import load_tokenizer


class ModelNotFoundError(StageError):
    """The --model argument names no model directory or MLflow model; the message says what was looked for."""


def is_mlflow_uri(ref: str) -> bool:
    return "://" in ref or ref.startswith(("models:/", "runs:/"))


def resolve_model(ref: str, root: Path = Path(".")) -> tuple[Path, Path]:
    """(model dir, tokenizer dir) for a directory or an MLflow model URI (downloaded from the project's store)."""
    if is_mlflow_uri(ref):
        return _from_mlflow(ref, root)
    path = Path(ref)
    for model_dir, tokenizer_dir in ((path, path.parent / "tokenizer"), (path / "model", path / "tokenizer"),
                                     (path / "artifacts" / "model", path / "artifacts" / "tokenizer")):
        if (model_dir / CONFIG_FILE).is_file() and (tokenizer_dir / "tokenizer.json").is_file():
            return model_dir, tokenizer_dir
    raise ModelNotFoundError(
        f"{ref}: not a model: expected a model dir ({CONFIG_FILE} + model.safetensors) with a sibling tokenizer/ "
        "dir (artifacts/model), a dir holding model/ and tokenizer/, or an MLflow URI such as models:/ultrathink@champion")


def _from_mlflow(uri: str, root: Path) -> tuple[Path, Path]:
    """Download the pyfunc model's files (to MLflow's temp dir) and point at its `model`/`tokenizer` artifacts."""
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
    artifacts = (mlmodel.get("flavors", {}).get("python_function", {}) or {}).get("artifacts") or {}
    if "model" not in artifacts or "tokenizer" not in artifacts:
        raise ModelNotFoundError(f"{uri}: not an UltraThink model (its MLmodel names no model and tokenizer artifacts)")
    return local / artifacts["model"]["path"], local / artifacts["tokenizer"]["path"]


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
    model_dir, tokenizer_dir = resolve_model(model_ref, root)
    return score_documents(UltraThink.from_pretrained(model_dir), load_tokenizer(tokenizer_dir), documents)
