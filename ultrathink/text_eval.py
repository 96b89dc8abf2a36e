"""Score any text under a trained model: its loss (nats per token) and bits per byte under the model's own tokenizer.

A model is named by either
  - a directory: a model dir (config.json + model.safetensors) whose tokenizer is the sibling `tokenizer/` dir (the
    pipeline's artifacts/model + artifacts/tokenizer layout), or a directory holding `model/` and `tokenizer/`;
  - an MLflow model URI (`models:/ultrathink@champion`, `runs:/...`): the logged pyfunc's artifacts hold the same
    `model` and `tokenizer` directories (see ultrathink/registry/promote.py).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ultrathink.errors import StageError
from ultrathink.evaluate import bits_per_byte
from ultrathink.model import UltraThink
from ultrathink.model.model import CONFIG_FILE
from ultrathink.tokenizer import load_tokenizer
from ultrathink.train.trainer import mean_loss

_BATCH = 8  # windows scored per forward pass


class ModelNotFoundError(StageError):
    """The --model argument names no model directory or MLflow model; the message says what was looked for."""


@dataclass
class TextScore:
    loss: float  # mean next-token loss in nats over the text's tokens
    bits_per_byte: float
    perplexity: float
    tokens: int  # tokens of the text, each one predicted (the first from the document-start EOS)
    bytes: int  # UTF-8 bytes of the text

    def to_dict(self) -> dict:
        return asdict(self)


def resolve_model(ref: str, root: Path = Path(".")) -> tuple[Path, Path]:
    """(model dir, tokenizer dir) for a directory or an MLflow model URI (downloaded from the project's store)."""
    if "://" in ref or ref.startswith("models:/") or ref.startswith("runs:/"):
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
    return resolve_model(str(local / "artifacts"))


def score_text(model: UltraThink, tokenizer, text: str) -> TextScore:
    """Loss and bits per byte of `text`: every token is predicted, the first from an EOS (a document start, as in
    training), each later one from up to seq_len tokens before it (windows that do not overlap in what they score)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError("the text is empty: there is nothing to score")
    tokens = torch.tensor([tokenizer.eos_token_id, *ids], dtype=torch.long)
    loss, predicted = mean_loss(model, _windows(tokens, model.cfg.seq_len), "fp32")
    n_bytes = len(text.encode("utf-8"))
    return TextScore(loss=loss, bits_per_byte=bits_per_byte(loss, predicted, n_bytes), perplexity=math.exp(loss),
                     tokens=predicted, bytes=n_bytes)


def _windows(tokens: torch.Tensor, seq_len: int):
    """(x, y) batches covering every next-token prediction once: full windows of seq_len in batches, then the
    ragged last window alone (mean_loss weights each batch by its number of targets)."""
    n_full = (len(tokens) - 1) // seq_len
    full = tokens[: n_full * seq_len + 1]
    starts = list(range(0, n_full * seq_len, seq_len))
    for i in range(0, len(starts), _BATCH):
        rows = torch.stack([full[s : s + seq_len + 1] for s in starts[i : i + _BATCH]])
        yield rows[:, :-1], rows[:, 1:]
    rest = tokens[n_full * seq_len :]
    if len(rest) > 1:
        yield rest[None, :-1], rest[None, 1:]


def evaluate_text_file(model_ref: str, text_file: Path, root: Path = Path(".")) -> TextScore:
    """`ultrathink eval`: score the UTF-8 text of `text_file` under the model named by `model_ref`."""
    text_file = Path(text_file)
    if not text_file.is_file():
        raise StageError(f"text file not found: {text_file}")
    try:
        text = text_file.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise StageError(f"{text_file}: not valid UTF-8 at byte {exc.start}: {exc.reason}") from None
    if not text:
        raise StageError(f"{text_file}: empty: there is nothing to score")
    model_dir, tokenizer_dir = resolve_model(model_ref, root)
    return score_text(UltraThink.from_pretrained(model_dir), load_tokenizer(tokenizer_dir), text)
