"""Alignment with the pretraining Trainer: the model to align (the fine-tuned champion, pinned to its version, or a
model dir), LoRA adapters or every weight trainable, the preference objective (align.dpo) on padded pairs whose
reference log-probabilities are computed once, before the first step, by the same model (LoRA's adapters start as
the identity) — so the reference is frozen by construction — and held-out pairs for validation and the
best-checkpoint choice. Checkpoints resume by a fingerprint of exactly this configuration (knobs, pairs, code, base
weights), as pretraining's and fine-tuning's do."""

from __future__ import annotations

import torch

from ultrathink.align.dpo import PairBatches, PairEval, PairRows, Preference
from ultrathink.config import Params, TrainConfig
from ultrathink.config.fingerprint import post_training_params_hash
from ultrathink.finetune.sft import Base, Setup, adapted_model, post_training_config
from ultrathink.hashing import json_hash
from ultrathink.lineage import code_hash
from ultrathink.scoring import pair_logprobs
from ultrathink.train.checkpoint import CheckpointManager, Fingerprint
from ultrathink.train.distributed import Distributed
from ultrathink.train.engine import autocast, build_engine
from ultrathink.train.plan import Plan, PlanBook, apply_plan, plan_on_main, plan_run
from ultrathink.train.trainer import Trainer, ready_model

# The entry point whose module closure determines an aligned model's weights (lineage.module_closure).
ALIGN_CODE = "ultrathink.stages.align"


def train_config(params: Params) -> TrainConfig:
    return post_training_config(params.train, params.align)


def fingerprint(params: Params, base: Base, train_pairs: list, val_pairs: list, plan: Plan) -> Fingerprint:
    return Fingerprint(post_training_params_hash("align", params.align, train_config(params)),
                       json_hash({"train": train_pairs, "val": val_pairs}),
                       code_hash(ALIGN_CODE), base.weights_sha256, json_hash(plan.decisions()))


def reference(model: torch.nn.Module, tokenizer, pairs: list, precision: str, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's summed log-probabilities of each pair's chosen and rejected answer: the model as it starts,
    in eval mode, in the training precision (so the policy's first forward matches it)."""
    return pair_logprobs(model, tokenizer, pairs, context=lambda: autocast(precision, str(device)))


def build(params: Params, base: Base, tokenizer, train_pairs: list, val_pairs: list, dist: Distributed,
          log_metrics=None) -> tuple[Setup, tuple[torch.Tensor, torch.Tensor]]:
    """The model with adapters (or all weights trainable) on `dist.device`, wrapped for `dist`'s backend, its pair
    batches with the reference's log-probabilities (each rank its slice of every global batch) and the Trainer,
    checkpointing into this configuration's own folder of paths.align_checkpoint_dir. Also returns the held-out
    pairs' reference log-probabilities (chosen, rejected), which the implicit rewards are measured against."""
    cfg, al = train_config(params), params.align
    trained, adapted, _ = adapted_model(al, base)
    decided = plan_on_main(dist, lambda: plan_run(trained.cfg, cfg, trained.vocab_size, train_pairs, val_pairs,
                                                  dist.device, dist.world_size, PlanBook(params.paths.align_plan)))
    _, cfg = apply_plan(decided.plan, trained.cfg, cfg)
    seq_len = trained.cfg.seq_len
    checkpoints = CheckpointManager(params.paths.align_checkpoint_dir,
                                    fingerprint(params, base, train_pairs, val_pairs, decided.plan),
                                    cfg.keep_checkpoints, cfg.keep_configs,
                                    extra={"base_model": base.pinned, "method": al.method, "loss": al.loss})
    model = ready_model(trained, cfg, decided.plan.kernel, dist)
    train_ref = reference(model, tokenizer, train_pairs, cfg.precision, dist.device)
    val_ref = reference(model, tokenizer, val_pairs, cfg.precision, dist.device)
    engine = build_engine(model, cfg, dist)
    batches = PairBatches(PairRows.of(tokenizer, train_pairs, seq_len, train_ref), seq_len, cfg.batch_size, al.seed,
                          dist.rank, dist.world_size)
    trainer = Trainer(engine, batches, PairEval(PairRows.of(tokenizer, val_pairs, seq_len, val_ref)), cfg,
                      checkpoints, log_metrics, dist, peak_flops=decided.peak_flops,
                      objective=Preference(al.beta, al.loss))
    return Setup(trainer, adapted, lambda: adapted_model(al, base)[:2]), val_ref
