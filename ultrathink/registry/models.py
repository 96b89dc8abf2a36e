"""Naming a model: a model directory (artifacts/model, a dir holding model/ and tokenizer/), a Hugging Face checkpoint
directory (config.json, safetensors and tokenizer files in one dir), a training checkpoint (with the run's tokenizer),
or an MLflow model URI (models:/NAME@ALIAS, models:/NAME/N, runs:/ID/model, downloaded from the project's store)
→ its files. Every place
a model is named (the CLI's --model, train.init_from, finetune.init_from, the champion's re-scoring) resolves here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from ultrathink.data.sources import split_documents
from ultrathink.device import DeviceLike
from ultrathink.errors import StageError
from ultrathink.model.hf import is_hf_checkpoint
from ultrathink.model.model import CONFIG_FILE
from ultrathink.scoring import TextScore
from ultrathink.text_eval import ModelFiles, score_model
from ultrathink.tokenizer import tokenizer_hash
from ultrathink.train.checkpoint import is_checkpoint, read_checkpoint


class ModelNotFoundError(StageError):
    """The --model argument names no model directory or MLflow model; the message says what was looked for."""



def is_mlflow_uri(ref: str) -> bool:
    return "://" in ref or ref.startswith(("models:/", "runs:/"))


def resolve_model(ref: str, root: Path = Path("."), tokenizer_dir: Path | None = None) -> tuple[Path, Path]:
    """(model dir, tokenizer dir) for a directory or an MLflow model URI (downloaded from the project's store)."""
    files = resolve_model_files(ref, root, tokenizer_dir)
    return files.model_dir, files.tokenizer_dir


def resolve_model_files(ref: str, root: Path = Path("."), tokenizer_dir: Path | None = None) -> ModelFiles:
    """The files of the model `ref` names. A training checkpoint holds no tokenizer: `tokenizer_dir` (the run's,
    paths.tokenizer_dir) is used when it is the one the checkpoint was trained with."""
    if is_mlflow_uri(ref):
        return _from_mlflow(ref, root)
    path = Path(ref)
    if is_hf_checkpoint(path):
        if not (path / "tokenizer.json").is_file():
            raise ModelNotFoundError(f"{ref}: a Hugging Face checkpoint without its tokenizer (tokenizer.json): "
                                     "copy the model's tokenizer files into it")
        return ModelFiles(path, path)
    if is_checkpoint(path):
        return ModelFiles(path, _checkpoint_tokenizer(path, tokenizer_dir))
    for model_dir, tokenizer in ((path, path.parent / "tokenizer"), (path / "model", path / "tokenizer"),
                                 (path / "artifacts" / "model", path / "artifacts" / "tokenizer")):
        if (model_dir / CONFIG_FILE).is_file() and (tokenizer / "tokenizer.json").is_file():
            return ModelFiles(model_dir, tokenizer)
    raise ModelNotFoundError(
        f"{ref}: not a model: expected a model dir ({CONFIG_FILE} + model.safetensors) with a sibling tokenizer/ "
        "dir (artifacts/model), a dir holding model/ and tokenizer/, a Hugging Face checkpoint dir (config.json, "
        "model.safetensors, tokenizer.json), a training checkpoint (artifacts/checkpoints/<config>/best), or an "
        "MLflow URI such as models:/ultrathink@champion")


def _checkpoint_tokenizer(checkpoint: Path, tokenizer_dir: Path | None) -> Path:
    recorded = read_checkpoint(checkpoint).manifest.get("tokenizer_sha256")
    if tokenizer_dir is None or not (Path(tokenizer_dir) / "tokenizer.json").is_file():
        raise ModelNotFoundError(f"{checkpoint}: a training checkpoint holds no tokenizer, and there is none at "
                                 f"{tokenizer_dir} (paths.tokenizer_dir) to use with it")
    if recorded and tokenizer_hash(tokenizer_dir) != recorded:
        raise ModelNotFoundError(f"{checkpoint}: trained with tokenizer {recorded}, but {tokenizer_dir} holds "
                                 f"{tokenizer_hash(tokenizer_dir)} (paths.tokenizer_dir has changed since)")
    return Path(tokenizer_dir)


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


@dataclass(frozen=True)
class NamedModel:
    """A model as a setting named it (`ref`), the exact version that was (`pinned`: an alias resolved to the
    version it names now, which is what lineage records; a directory as given), and its files."""
    ref: str
    pinned: str
    files: ModelFiles


def resolve_named_model(ref: str, root: Path = Path(".")) -> NamedModel:
    """train.init_from / finetune.init_from → the model's files, an MLflow alias pinned first."""
    pinned = ref
    if is_mlflow_uri(ref):  # MLflow is imported for a name in the registry only: not by a directory's ranks
        from ultrathink.registry.tracking import pin_model_uri

        pinned = pin_model_uri(ref, root)
    return NamedModel(ref, pinned, resolve_model_files(pinned, root))


def evaluate_text_file(model_ref: str, text_file: Path, unit: str = "paragraph", root: Path = Path("."),
                       device: DeviceLike | None = None, tokenizer_dir: Path | None = None) -> TextScore:
    """`ultrathink eval`: score the UTF-8 text of `text_file` under the model named by `model_ref` (a directory or an
    MLflow URI), split into
    documents as the data loader splits a .txt source (`unit`: paragraph, line or file; data.txt_unit), on
    `device` (None or "auto": the GPU when there is one)."""
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
    return score_model(resolve_model_files(model_ref, root, tokenizer_dir), documents, device=device)
