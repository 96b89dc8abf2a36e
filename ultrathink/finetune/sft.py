"""Supervised fine-tuning with the pretraining Trainer: the base model (the champion, pinned to its version, or a
model dir), LoRA adapters or every weight trainable, padded chats whose targets are the answers only, and held-out
chats for validation and the best-checkpoint choice. Checkpoints resume by a fingerprint of exactly this
configuration (knobs, pairs, code, base weights), as pretraining's do."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import PeftModel

from ultrathink.config import AlignConfig, FinetuneConfig, Params, TrainConfig
from ultrathink.errors import StageError
from ultrathink.model.chat import reply
from ultrathink.finetune.lora import add_adapters, merged, quantize_base
from ultrathink.finetune.pairs import ChatBatches, ChatEval
from ultrathink.lineage import code_hash
from ultrathink.model import UltraThink
from ultrathink.model.model import weights_sha256
from ultrathink.registry.champion import CHAMPION
from ultrathink.scoring import TextScore, score_conversations
from ultrathink.registry.models import resolve_named_model
from ultrathink.config.fingerprint import post_training_params_hash
from ultrathink.hashing import json_hash
from ultrathink.train.checkpoint import CheckpointManager, Fingerprint
from ultrathink.train.plan import Plan, PlanBook, apply_plan, plan_on_main, plan_run
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


def resolve_base(ref: str, registered_name: str, root: Path = Path("."), pinned: str | None = None) -> Base:
    """A post-training stage's init_from → local files: `champion` is `registered_name`'s champion (fine-tuning's
    registry.model_name, alignment's registry.finetuned_name); an alias is pinned to the version it names now,
    which is what the lineage records. `pinned`: the version the main rank resolved, so every rank reads the same
    one even if the alias moves meanwhile."""
    uri = pinned or (f"models:/{registered_name}@{CHAMPION}" if ref == CHAMPION else ref)
    named = resolve_named_model(uri, root)
    files = named.files
    return Base(ref, named.pinned, files.model_dir, files.tokenizer_dir, weights_sha256(files.model_dir))


def train_config(params: Params) -> TrainConfig:
    return post_training_config(params.train, params.finetune)


def post_training_config(train: TrainConfig, ft: FinetuneConfig | AlignConfig) -> TrainConfig:
    """train.* (precision, attention kernel, optimizer, β₂, clipping, threads, checkpoint keeping) with the stage's
    (finetune.*'s or align.*'s) steps, learning rate, β₁, batch and schedule; no budget, no compile, the best
    held-out checkpoint kept."""
    return TrainConfig.model_validate({
        **train.model_dump(), "max_steps": ft.max_steps, "budget": None, "lr": ft.lr,
        "warmup_steps": ft.warmup_steps, "warmup_fraction": None, "seq_len_warmup": 0.0,
        "weight_decay": ft.weight_decay, "beta1": ft.beta1,
        "schedule": ft.schedule, "batch_size": ft.batch_size, "grad_accum": 1, "seed": ft.seed,
        "eval_every": ft.eval_every, "eval_batches": 10**9, "checkpoint_every": ft.eval_every,
        "log_every": min(train.log_every, ft.eval_every), "compile": False, "init_from": None,
        "init_optimizer": False, "early_stopping_patience": None, "decay_patience": None, "select": "best",
        "ema_horizon": 0.0})


def fingerprint(params: Params, base: Base, train_chats: list, val_chats: list, plan: Plan) -> Fingerprint:
    return Fingerprint(post_training_params_hash("finetune", params.finetune, train_config(params)),
                       json_hash({"train": train_chats, "val": val_chats}),
                       code_hash(FINETUNE_CODE), base.weights_sha256, json_hash(plan.decisions()))


class ShardedQuantizedError(StageError):
    """finetune.quantize under FSDP: torchao's quantized weights are not sharded by fully_shard."""


@dataclass
class Setup:
    trainer: Trainer
    adapted: PeftModel | None  # the PEFT wrapper under LoRA (None: full fine-tuning)
    rebuild: Callable[[], tuple[UltraThink, PeftModel | None]]  # a fresh, unwrapped copy of the model and wrapper
    quantized: tuple[int, int] | None = None  # finetune.quantize: bytes of the adapted layers' weights before, after

    def final_model(self) -> UltraThink | None:
        """The trained model as plain UltraThink weights (adapters merged), on the main rank; None on the others.
        Every rank calls it: under FSDP the weights are gathered (collective) into a fresh unsharded copy."""
        trainer = self.trainer
        if not trainer.dist.sharded:
            if not trainer.dist.is_main:
                return None
            return merged(self.adapted) if self.adapted is not None else trainer.model
        weights = trainer.full_weights()
        if not trainer.dist.is_main:
            return None
        model, adapted = self.rebuild()
        model.load_state_dict(weights)
        return (merged(adapted) if adapted is not None else model).to(trainer.dist.device)


def adapted_model(ft: FinetuneConfig | AlignConfig, base: Base, quantize: str | None = None
                  ) -> tuple[UltraThink, PeftModel | None, tuple[int, int] | None]:
    """The base model in fp32 (an open model may be stored in bf16), its adapted layers quantized when `quantize`
    (finetune.quantize) says so, with LoRA adapters (seeded by the stage's seed) under its method lora: the model
    to train, the PEFT wrapper (None: full fine-tuning) and the quantized bytes (before, after)."""
    model = UltraThink.from_pretrained(base.model_dir, dtype=torch.float32)
    quantized = quantize_base(model, quantize, ft.lora.target_modules) if quantize else None
    torch.manual_seed(ft.seed)  # the adapters' initial A matrices
    adapted = add_adapters(model, ft.lora) if ft.method == "lora" else None
    return (adapted.get_base_model() if adapted is not None else model), adapted, quantized


def build(params: Params, base: Base, tokenizer, train_chats: list, val_chats: list, dist: Distributed,
          log_metrics=None) -> Setup:
    """The base model with adapters (or all weights trainable) on `dist.device`, wrapped for `dist`'s backend, its
    chat batches (each rank its slice of every global batch) and the Trainer, checkpointing into this
    configuration's own folder of paths.finetune_checkpoint_dir."""
    cfg, ft = train_config(params), params.finetune
    if ft.quantize and dist.sharded:
        raise ShardedQuantizedError(f"finetune.quantize {ft.quantize} cannot be sharded by FSDP: fine-tune a quantized "
                                    "base on one process or on several ranks with train.backend ddp")
    trained, adapted, quantized = adapted_model(ft, base, ft.quantize)
    # Precision and attention kernel: decided once per configuration and machine class, as pretraining's.
    decided = plan_on_main(dist, lambda: plan_run(trained.cfg, cfg, trained.vocab_size, train_chats, val_chats,
                                                  dist.device, dist.world_size, PlanBook(params.paths.finetune_plan)))
    _, cfg = apply_plan(decided.plan, trained.cfg, cfg)
    seq_len = trained.cfg.seq_len
    checkpoints = CheckpointManager(params.paths.finetune_checkpoint_dir,
                                    fingerprint(params, base, train_chats, val_chats, decided.plan),
                                    cfg.keep_checkpoints,
                                    cfg.keep_configs, extra={"base_model": base.pinned, "method": ft.method})
    engine = build_engine(ready_model(trained, cfg, decided.plan.kernel, dist), cfg, dist)
    batches = ChatBatches(tokenizer, train_chats, seq_len, cfg.batch_size, ft.seed, dist.rank, dist.world_size)
    trainer = Trainer(engine, batches, ChatEval(tokenizer, val_chats, seq_len), cfg, checkpoints, log_metrics, dist,
                      peak_flops=decided.peak_flops)
    return Setup(trainer, adapted, lambda: adapted_model(ft, base, ft.quantize)[:2], quantized)


def score(model: UltraThink, tokenizer, chats: list) -> TextScore:
    """Loss on the answer tokens of `chats` (and bits per answer byte), in fp32."""
    return score_conversations(model, tokenizer, chats)


def sample_answers(model: UltraThink, tokenizer, chats: list, params: Params) -> list[str]:
    """Greedy answers to each chat's turns before its last answer."""
    ev = params.evaluate
    return [reply(model, tokenizer, chat[:-1], ev.max_new_tokens, 0.0, ev.top_k, ev.seed, ev.top_p) for chat in chats]
