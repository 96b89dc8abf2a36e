"""Supervised fine-tuning with the pretraining Trainer: the base model (the champion, pinned to its version, or a
model dir), LoRA adapters or every weight trainable, padded chats whose targets are the answers only, and held-out
chats for validation and the best-checkpoint choice. Checkpoints resume by a fingerprint of exactly this
configuration (knobs, pairs, code, base weights), as pretraining's do."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from peft import PeftModel

from ultrathink.config import Params, TrainConfig
from ultrathink.model.chat import reply
from ultrathink.finetune.lora import add_adapters, merged, quantize_base
from ultrathink.finetune.pairs import ChatBatches, ChatEval
from ultrathink.lineage import code_hash
from ultrathink.model import UltraThink
from ultrathink.model.model import weights_sha256
from ultrathink.registry.champion import CHAMPION
from ultrathink.scoring import TextScore, score_conversations
from ultrathink.registry.models import resolve_named_model
from ultrathink.config.fingerprint import finetune_params_hash
from ultrathink.hashing import json_hash
from ultrathink.train.checkpoint import CheckpointManager, Fingerprint
from ultrathink.train.plan import Plan, PlanBook, apply_plan, plan_run
from ultrathink.train.distributed import Distributed
from ultrathink.train.engine import build_engine
from ultrathink.train.trainer import Trainer, ready_model

# The entry point whose module closure determines a fine-tuned model's weights (lineage.module_closure).
FINETUNE_CODE = "ultrathink.stages.finetune"


@dataclass(frozen=True)
class Base:
    """The pretrained model fine-tuning starts from."""

    ref: str  # as finetune.init_from named it
    pinned: str  # the URI of the exact version (an alias resolved), or the directory
    model_dir: Path
    tokenizer_dir: Path
    weights_sha256: str

    def tags(self) -> dict[str, str]:
        return {"base_model": self.pinned, "base_model_ref": self.ref, "base_weights_sha256": self.weights_sha256}


def resolve_base(params: Params, root: Path = Path(".")) -> Base:
    """finetune.init_from → local files: `champion` is registry.model_name's champion; an alias is pinned to the
    version it names now, which is what the lineage records."""
    ref = params.finetune.init_from
    uri = f"models:/{params.registry.model_name}@{CHAMPION}" if ref == CHAMPION else ref
    named = resolve_named_model(uri, root)
    files = named.files
    return Base(ref, named.pinned, files.model_dir, files.tokenizer_dir, weights_sha256(files.model_dir))


def train_config(params: Params) -> TrainConfig:
    """train.* (precision, attention kernel, optimizer, clipping, threads, checkpoint keeping) with finetune.*'s
    steps, learning rate, batch and schedule; no budget, no compile, the best held-out checkpoint kept."""
    ft = params.finetune
    return TrainConfig.model_validate({
        **params.train.model_dump(), "max_steps": ft.max_steps, "budget": None, "lr": ft.lr,
        "warmup_steps": ft.warmup_steps, "warmup_fraction": None, "weight_decay": ft.weight_decay,
        "schedule": ft.schedule, "batch_size": ft.batch_size, "grad_accum": 1, "seed": ft.seed,
        "eval_every": ft.eval_every, "eval_batches": 10**9, "checkpoint_every": ft.eval_every,
        "log_every": min(params.train.log_every, ft.eval_every), "compile": False, "init_from": None,
        "init_optimizer": False, "early_stopping_patience": None, "select": "best"})


def fingerprint(params: Params, base: Base, train_chats: list, val_chats: list, plan: Plan) -> Fingerprint:
    return Fingerprint(finetune_params_hash(params.finetune, train_config(params)),
                       json_hash({"train": train_chats, "val": val_chats}),
                       code_hash(FINETUNE_CODE), base.weights_sha256, json_hash(plan.decisions()))


@dataclass
class Setup:
    trainer: Trainer
    adapted: PeftModel | None  # the PEFT wrapper under LoRA (None: full fine-tuning)
    quantized: tuple[int, int] | None = None  # finetune.quantize: bytes of the adapted layers' weights before, after

    def final_model(self) -> UltraThink:
        """The trained model as plain UltraThink weights (adapters merged)."""
        return merged(self.adapted) if self.adapted is not None else self.trainer.model


def build(params: Params, base: Base, tokenizer, train_chats: list, val_chats: list, dist: Distributed,
          log_metrics=None) -> Setup:
    """The base model with adapters (or all weights trainable) on `dist.device`, its chat batches and the Trainer,
    checkpointing into this configuration's own folder of paths.finetune_checkpoint_dir."""
    cfg, ft = train_config(params), params.finetune
    model = UltraThink.from_pretrained(base.model_dir, dtype=torch.float32)  # an open model may be stored in bf16
    # Precision and attention kernel: decided once per configuration and machine class, as pretraining's.
    decided = plan_run(model.cfg, cfg, model.vocab_size, train_chats, val_chats, dist.device, dist.world_size,
                       PlanBook(params.paths.finetune_plan))
    _, cfg = apply_plan(decided.plan, model.cfg, cfg)
    quantized = quantize_base(model, ft.quantize, ft.lora.target_modules) if ft.quantize else None
    torch.manual_seed(ft.seed)  # the adapters' initial A matrices
    adapted = add_adapters(model, ft.lora) if ft.method == "lora" else None
    trained = adapted.get_base_model() if adapted is not None else model
    seq_len = model.cfg.seq_len
    checkpoints = CheckpointManager(params.paths.finetune_checkpoint_dir,
                                    fingerprint(params, base, train_chats, val_chats, decided.plan),
                                    cfg.keep_checkpoints,
                                    cfg.keep_configs, extra={"base_model": base.pinned, "method": ft.method})
    engine = build_engine(ready_model(trained, cfg, decided.plan.kernel, dist), cfg, dist)
    trainer = Trainer(engine, ChatBatches(tokenizer, train_chats, seq_len, cfg.batch_size, ft.seed),
                      ChatEval(tokenizer, val_chats, seq_len), cfg, checkpoints, log_metrics, dist,
                      peak_flops=decided.peak_flops)
    return Setup(trainer, adapted, quantized)


def score(model: UltraThink, tokenizer, chats: list) -> TextScore:
    """Loss on the answer tokens of `chats` (and bits per answer byte), in fp32."""
    return score_conversations(model, tokenizer, chats)


def sample_answers(model: UltraThink, tokenizer, chats: list, params: Params) -> list[str]:
    """Greedy answers to each chat's turns before its last answer."""
    ev = params.evaluate
    return [reply(model, tokenizer, chat[:-1], ev.max_new_tokens, 0.0, ev.top_k, ev.seed, ev.top_p) for chat in chats]
