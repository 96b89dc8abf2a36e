"""Warm start (`train.init_from`): begin training from existing weights instead of a random init.

The parent is a model directory (`artifacts/model`: config.json + model.safetensors), a checkpoint directory
(`artifacts/checkpoints/<config>/step_N` or `best`, which also carries optimizer state), a Hugging Face checkpoint of
the Llama family (continued pretraining of an open model: the architecture is the parent's, model/hf.py), or —
resolved to a local directory by the caller, since the trainer knows nothing of MLflow — a registered model. Before any training the
parent must match this run's architecture (every tensor name and shape) and tokenizer (vocabulary and merges);
otherwise the run stops naming the tensors or tokens that differ. The parent's weights hash enters the run's
fingerprint, so a warm-started run never resumes a cold run's checkpoints or one warm-started from other weights.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from ultrathink.config import ModelConfig
from ultrathink.errors import StageError
from ultrathink.model import hf
from ultrathink.model.model import CONFIG_FILE, WEIGHTS_FILE
from ultrathink.tokenizer import tokenizer_hash, vocab_difference
from ultrathink.hashing import file_sha256
from ultrathink.lineage import LINEAGE_FILE
from ultrathink.train.checkpoint import Checkpoint, is_checkpoint, read_checkpoint
from ultrathink.train.sharded import OPTIMIZER_DIR

log = logging.getLogger(__name__)


class WarmStartError(StageError):
    """train.init_from names nothing loadable, or weights that do not fit this run; the message says what differs."""


@dataclass
class Parent:
    ref: str  # train.init_from as written
    lineage: str  # what lineage tags record: models:/NAME/VERSION, or an absolute path
    directory: Path  # holds config.json + model.safetensors
    weights_sha256: str
    tokenizer_sha256: str | None  # None when neither a tokenizer nor a record of one comes with the parent
    tokenizer_dir: Path | None
    checkpoint: Checkpoint | None  # set when the parent is a checkpoint (its optimizer state can be loaded too)
    open_model: bool = False  # a Hugging Face checkpoint: its config decides the architecture

    def tags(self) -> dict[str, str]:
        return {"parent_model": self.lineage, "parent_sha256": self.weights_sha256}


def find_parent(directory: Path, ref: str, lineage: str | None = None, tokenizer_dir: Path | None = None) -> Parent:
    """The parent in a local directory: a checkpoint dir or a model dir (its tokenizer is `tokenizer_dir`, else
    a sibling `tokenizer/`, else what its lineage.json or manifest records)."""
    directory = Path(directory)
    checkpoint = None
    if hf.is_hf_checkpoint(directory):
        own = directory / "tokenizer.json"
        tokenizer_dir = tokenizer_dir or (directory if own.is_file() else None)
        return Parent(ref, lineage or str(directory.resolve()), directory, hf.weights_sha256(directory)[:16],
                      tokenizer_hash(tokenizer_dir) if tokenizer_dir else None, tokenizer_dir, None, open_model=True)
    if is_checkpoint(directory):
        try:
            checkpoint = read_checkpoint(directory)
        except ValueError as exc:
            raise WarmStartError(f"train.init_from: {exc}") from None
        recorded = checkpoint.manifest.get("tokenizer_sha256")
    elif (directory / CONFIG_FILE).is_file() and (directory / WEIGHTS_FILE).is_file():
        record = directory / LINEAGE_FILE
        recorded = json.loads(record.read_text()).get("tokenizer_sha256") if record.is_file() else None
    else:
        raise WarmStartError(f"train.init_from: {ref}: not a model dir ({CONFIG_FILE} + {WEIGHTS_FILE}), a "
                             "checkpoint dir (manifest.json + state.pt), a Hugging Face checkpoint dir (config.json "
                             "with a model_type, safetensors) or an MLflow model URI (models:/NAME@ALIAS)")
    if tokenizer_dir is None and (directory.parent / "tokenizer" / "tokenizer.json").is_file():
        tokenizer_dir = directory.parent / "tokenizer"
    tok_sha = tokenizer_hash(tokenizer_dir) if tokenizer_dir is not None else recorded
    return Parent(ref, lineage or str(directory.resolve()), directory, file_sha256(directory / WEIGHTS_FILE)[:16],
                  tok_sha, tokenizer_dir, checkpoint)


def load_parent_weights(parent: Parent, model: torch.nn.Module, tokenizer_sha256: str | None,
                        tokenizer_dir: Path | None = None) -> None:
    """Check that the parent fits `model` and this run's tokenizer, then copy its weights into `model`."""
    _check_tokenizer(parent, tokenizer_sha256, tokenizer_dir)
    if parent.open_model:  # names and shapes are checked against the model as they are read
        weights = hf.read_weights(parent.directory, model.state_dict())
    else:
        weights = load_file(parent.directory / WEIGHTS_FILE)
        _check_tensors(parent, weights, model.state_dict())
    model.load_state_dict(weights)  # copied into the model's (fp32) parameters
    log.warning("warm start from %s (%s, weights %s)", parent.ref, parent.lineage, parent.weights_sha256)


def open_model_config(parent: Parent, requested: ModelConfig, tokenizer_vocab: int) -> tuple[ModelConfig, int]:
    """(ModelConfig, vocab size) of an open-model parent for continued pretraining: its architecture, with this
    run's training knobs (dropout) and context (model.seq_len when set: at most the parent's). Architecture keys
    model.* sets that disagree with the parent's config are an error naming them."""
    source = f"train.init_from: {parent.ref}"
    try:
        cfg, vocab = hf.model_config(hf.read_config(parent.directory), base=requested, source=source)
    except hf.UnsupportedModelError as exc:
        raise WarmStartError(str(exc)) from None
    if requested.size == "auto":
        raise WarmStartError(f"{source}: model.size auto sizes a new model, but this one continues the parent's "
                             "architecture: set model.size manual")
    if requested.variants():
        names = ", ".join(f"model.{n}" for n, f in type(requested).model_fields.items()
                          if getattr(requested, n) in requested.variants())
        raise WarmStartError(f"{source}: {names} enabled, but the parent is a dense model (turn it off)")
    given = requested.set_by_user()
    seq_len = given.pop("seq_len", None)
    conflicts = [f"model.{k}: {v} (the parent's: {getattr(cfg, k)})" for k, v in given.items()
                 if v != (getattr(cfg, k) if k != "ffn_hidden" else cfg.hidden)]
    if conflicts:
        raise WarmStartError(f"{source}: the architecture is the parent's, and model.* disagrees with it: "
                             f"{'; '.join(conflicts)} (leave these keys null or at their defaults)")
    if seq_len is not None:
        if seq_len > cfg.seq_len:
            raise WarmStartError(f"{source}: model.seq_len {seq_len} exceeds the parent's context {cfg.seq_len}")
        cfg = cfg.model_copy(update={"seq_len": seq_len})
    if vocab < tokenizer_vocab:
        raise WarmStartError(f"{source}: the parent's vocabulary ({vocab:,}) is smaller than this run's tokenizer "
                             f"({tokenizer_vocab:,}): use the parent's tokenizer (tokenizer.pretrained)")
    return cfg, vocab


def _check_tokenizer(parent: Parent, expected: str | None, tokenizer_dir: Path | None) -> None:
    if parent.tokenizer_sha256 is None or expected is None:
        log.warning("train.init_from: %s comes with no tokenizer or record of one; only the vocabulary size is "
                    "checked (through the embedding's shape)", parent.ref)
        return
    if parent.tokenizer_sha256 == expected:
        return
    detail = (vocab_difference(parent.tokenizer_dir, tokenizer_dir) if parent.tokenizer_dir and tokenizer_dir
              else f"tokenizer {parent.tokenizer_sha256} vs {expected}")
    hint = f" (for an open model: tokenizer.pretrained: {parent.ref})" if parent.open_model else ""
    raise WarmStartError(f"train.init_from: {parent.ref} was trained with another tokenizer than this run's "
                         f"(parent vs this run: {detail}); warm start needs the same tokenizer{hint}")


def _check_tensors(parent: Parent, weights: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    shapes = [f"{n} {tuple(weights[n].shape)} vs {tuple(expected[n].shape)}"
              for n in sorted(set(weights) & set(expected)) if weights[n].shape != expected[n].shape]
    problems = [f"{what}: {_first(items)}" for what, items in (
        ("shapes differ (parent vs this run)", shapes), ("tensors missing from the parent", missing),
        ("tensors this model lacks", unexpected)) if items]
    if problems:
        raise WarmStartError(f"train.init_from: {parent.ref} does not fit model.* of this run: {'; '.join(problems)}"
                             f"{_qk_norm_hint(missing, unexpected)}")


def _qk_norm_hint(missing: list[str], unexpected: list[str]) -> str:
    """Models saved before q/k norms became the default have none: say which key makes this run match them."""
    norms = ("q_norm.weight", "k_norm.weight")
    if missing and all(n.endswith(norms) for n in missing):
        return " (the parent has no q/k norms: set model.qk_norm: false)"
    if unexpected and all(n.endswith(norms) for n in unexpected):
        return " (the parent has q/k norms: set model.qk_norm: true)"
    return ""


def _first(items: list[str], show: int = 4) -> str:
    return ", ".join(items[:show]) + (f" and {len(items) - show} more" if len(items) > show else "")


def check_optimizer(parent: Parent, optimizer: str) -> Checkpoint:
    """train.init_optimizer: the parent must be a checkpoint made with the same optimizer."""
    if parent.checkpoint is None:
        raise WarmStartError(f"train.init_optimizer: {parent.ref} is a model, not a checkpoint: it holds no "
                             "optimizer state (use a step_N or best dir under paths.checkpoint_dir)")
    theirs = parent.checkpoint.manifest.get("optimizer")
    if theirs != optimizer:
        raise WarmStartError(f"train.init_optimizer: {parent.ref} was trained with optimizer {theirs}, this run "
                             f"uses {optimizer} (train.optimizer)")
    if not (parent.checkpoint.path / OPTIMIZER_DIR).is_dir():
        raise WarmStartError(f"train.init_optimizer: {parent.ref} holds no optimizer state this version reads (no "
                             f"{OPTIMIZER_DIR}/ folder: written by DeepSpeed, or by UltraThink before sharded "
                             "checkpoints); warm start from its weights alone (train.init_optimizer: false)")
    return parent.checkpoint
