"""The training loop. It takes a model, data, a TrainConfig, a checkpoint manager and a metrics callback; it knows
nothing of DVC, Prefect or MLflow."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from tqdm import tqdm

from ultrathink.config import TrainConfig
from ultrathink.errors import StageError
from ultrathink.train.checkpoint import CheckpointManager
from ultrathink.train.distributed import Distributed, as_float
from ultrathink.train.loader import TokenWindows, eval_batches
from ultrathink.train.optim import build_optimizers
from ultrathink.train.precision import peak_flops, resolve_precision
from ultrathink.train.schedule import Scheduler

log = logging.getLogger(__name__)

MetricsSink = Callable[[dict[str, float], int], None]


class NonFiniteLossError(StageError):
    """Training produced too many non-finite losses or gradients in a row; no checkpoint was written from them."""


def autocast(precision: str, device: str = "cpu"):
    kind = device.split(":")[0]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(resolve_precision(precision, kind))
    return torch.autocast(device_type=kind, dtype=dtype) if dtype else contextlib.nullcontext()


@torch.no_grad()
def mean_loss(model, batches, precision: str) -> tuple[float, int]:
    """Mean next-token loss over `batches` and the number of predicted tokens."""
    was_training = model.training
    model.eval()
    device = str(next(model.parameters()).device)
    total, count = 0.0, 0
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        with autocast(precision, device):
            _, loss = model(x, y)
        total += loss.item() * y.numel()
        count += y.numel()
    model.train(was_training)
    return total / max(count, 1), count


@dataclass
class TrainResult:
    step: int
    resumed_from: int | None
    history: list[dict[str, float]] = field(default_factory=list)
    seconds: float = 0.0
    tokens_per_second: float = 0.0
    skipped_steps: int = 0
    best_val_loss: float | None = None
    stopped_early: bool = False


class Trainer:
    def __init__(self, model: torch.nn.Module, train_loader: TokenWindows, val_tokens: np.ndarray,
                 cfg: TrainConfig, checkpoints: CheckpointManager, fingerprint: str,
                 log_metrics: MetricsSink | None = None, dist: Distributed | None = None):
        self.model, self.loader, self.val_tokens, self.cfg = model, train_loader, val_tokens, cfg
        self.checkpoints, self.fingerprint = checkpoints, fingerprint
        self.log_metrics = log_metrics or (lambda metrics, step: None)
        self.dist = dist or Distributed()
        # `engine` is what trains (the model or its data-parallel wrapper); `model` is what is saved and evaluated.
        model.to(self.dist.device)
        model.checkpoint_blocks = cfg.gradient_checkpointing
        self.engine = self.dist.wrap(model)
        if cfg.compile:
            self.engine = torch.compile(self.engine)
        # fp16 needs loss scaling so small gradients do not underflow; bf16 and fp32 do not (scaler disabled).
        self.scaler = torch.amp.GradScaler("cuda", enabled=resolve_precision(cfg.precision, self.dist.kind) == "fp16")
        self.optimizers = build_optimizers(model, cfg)
        self.scheduler = Scheduler(self.optimizers, cfg)
        self.step = 0
        self.history: list[dict[str, float]] = []
        # Guard and early-stopping counters are part of the state: a resumed run must make the same decisions.
        self.counters = {"skipped": 0, "bad_in_a_row": 0, "evals_without_gain": 0, "best_val": math.inf}
        self.tokens_per_step = cfg.batch_size * cfg.grad_accum * train_loader.seq_len * self.dist.world_size

    # ---- checkpoint state -------------------------------------------------------------------------------------
    def state(self) -> dict:
        return {
            "step": self.step,
            "optimizers": self.dist.optimizer_state(self.model, self.optimizers),
            "scheduler": self.scheduler.state_dict(),
            "loader": self.loader.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "grad_scaler": self.scaler.state_dict(),
            "history": self.history,
            "counters": dict(self.counters),
        }

    def resume(self) -> int | None:
        """Continue from the latest intact checkpoint made with the same config; otherwise start clean."""
        latest = self.checkpoints.latest()
        if latest is None:
            return None
        if not self.cfg.resume or latest.fingerprint != self.fingerprint:
            why = "train.resume is false" if not self.cfg.resume else "its config differs from this run's"
            log.warning("not resuming from %s: %s; starting fresh", latest.path, why)
            if self.dist.is_main:
                self.checkpoints.clear()
            self.dist.barrier()
            return None
        state = latest.load_state()
        self.dist.load_model_state(self.model, latest.load_weights())
        self.dist.load_optimizer_state(self.model, self.optimizers, state["optimizers"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.loader.load_state_dict(state["loader"])
        torch.set_rng_state(state["torch_rng"])
        self.scaler.load_state_dict(state["grad_scaler"])
        self.step, self.history, self.counters = state["step"], state["history"], dict(state["counters"])
        log.warning("resumed from %s at step %d", latest.path, self.step)
        return self.step

    # ---- the loop -------------------------------------------------------------------------------------------
    def _zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def train_step(self) -> tuple[float, float] | None:
        """One optimizer step over grad_accum micro-batches: (mean loss, gradient norm before clipping), or None
        when the loss or gradient is not finite — then the update is skipped and counted."""
        self.engine.train()
        total = 0.0
        for _ in range(self.cfg.grad_accum):
            x, y = (t.to(self.dist.device, non_blocking=True) for t in next(self.loader))
            with autocast(self.cfg.precision, self.dist.device):
                _, loss = self.engine(x, y)
            self.scaler.scale(loss / self.cfg.grad_accum).backward()
            total += loss.item() / self.cfg.grad_accum
        total = self.dist.mean(total)  # every rank sees the same loss, so all take the same skip decision
        for opt in self.optimizers:
            self.scaler.unscale_(opt)  # clip the true gradient norm, not the loss-scaled one
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else math.inf
        grad_norm = as_float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))
        if not math.isfinite(total) or (not math.isfinite(grad_norm) and not self.scaler.is_enabled()):
            self._zero_grad()
            self._count_bad_step(total, grad_norm)
            return None
        # Under fp16 an overflowed gradient is routine: the scaler skips that update and lowers its scale.
        self.counters["bad_in_a_row"] = 0
        for opt in self.optimizers:
            self.scaler.step(opt)
        self.scaler.update()
        self.scheduler.step()
        self.model.after_optimizer_step()  # MoE selection biases and DRE thresholds move once per update
        self._zero_grad()
        self.step += 1
        return total, grad_norm

    def _count_bad_step(self, loss: float, grad_norm: float) -> None:
        self.counters["skipped"] += 1
        self.counters["bad_in_a_row"] += 1
        log.warning("step %d: non-finite loss %s or gradient norm %s; update skipped (%d in a row)",
                    self.step + 1, loss, grad_norm, self.counters["bad_in_a_row"])
        if self.counters["bad_in_a_row"] >= self.cfg.max_bad_steps:
            raise NonFiniteLossError(
                f"{self.counters['bad_in_a_row']} consecutive steps with a non-finite loss or gradient at step "
                f"{self.step + 1} (train.max_bad_steps={self.cfg.max_bad_steps}); lower train.lr or check the data. "
                f"The last good checkpoint is kept in {self.checkpoints.directory}")

    def _save(self, name: str | None = None) -> None:
        """Every rank takes part in gathering the state; only the main process writes it."""
        self.dist.check_replicas(self.model)
        weights, state = self.full_weights(), self.state()
        if self.dist.is_main:
            self.checkpoints.save(self.step, self.fingerprint, self.model, state, name=name, weights=weights)
        self.dist.barrier()

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The whole model's weights (gathered from all ranks under FSDP; collective there)."""
        return self.dist.model_state(self.model)

    def validate(self) -> float:
        batches = eval_batches(self.val_tokens, self.loader.seq_len, self.cfg.batch_size, self.cfg.eval_batches)
        return mean_loss(self.model, batches, self.cfg.precision)[0]

    def _track_best(self, val_loss: float) -> bool:
        """Keep the best checkpoint apart from the last N; True when patience has run out."""
        if val_loss < self.counters["best_val"]:
            self.counters["best_val"], self.counters["evals_without_gain"] = val_loss, 0
            self._save(name="best")
            return False
        self.counters["evals_without_gain"] += 1
        patience = self.cfg.early_stopping_patience
        return patience is not None and self.counters["evals_without_gain"] >= patience

    def fit(self) -> TrainResult:
        """Train up to cfg.max_steps from the current step (call resume() first to continue a checkpoint)."""
        cfg, first_step, stop = self.cfg, self.step, False
        started, window_start, window_steps = time.perf_counter(), time.perf_counter(), 0
        bar = tqdm(total=cfg.max_steps, initial=self.step, desc="train", unit="step",
                   disable=None if self.dist.is_main else True, leave=False)
        flops_per_token = self.model.flops_per_token()
        peak = peak_flops(cfg.precision, self.dist.device) * self.dist.world_size
        while self.step < cfg.max_steps and not stop:
            outcome = self.train_step()
            if outcome is None:
                continue
            loss, grad_norm = outcome
            window_steps += 1
            bar.update(1)
            record = {"train_loss": loss, "lr": self.scheduler.get_last_lr()[0], "grad_norm": grad_norm,
                      "skipped_steps": float(self.counters["skipped"])}
            record.update(self.model.health_metrics())  # routing health of this step, before validate() reroutes
            last = self.step == cfg.max_steps
            if self.step % cfg.log_every == 0 or last:
                elapsed = time.perf_counter() - window_start
                record["tokens_per_second"] = window_steps * self.tokens_per_step / elapsed
                record["mfu"] = flops_per_token * record["tokens_per_second"] / peak
                window_start, window_steps = time.perf_counter(), 0
            if self.step % cfg.eval_every == 0 or last:
                record["val_loss"] = self.validate()
                stop = self._track_best(record["val_loss"])
            if self.dist.is_main:
                self.log_metrics(record, self.step)  # every step to the tracker; console and history less often
            if "tokens_per_second" in record or "val_loss" in record:
                self.history.append({"step": self.step, **record})
                if self.dist.is_main:
                    bar.write(" ".join(filter(None, [step_line(self.step, cfg.max_steps, record),
                                                     self.model.health_line(record)])))
            if self.step % cfg.checkpoint_every == 0 or last or stop:
                self._save()
        bar.close()
        if stop:
            log.warning("early stop at step %d: no val gain in %d validations; keeping the best model (val %.4f)",
                        self.step, cfg.early_stopping_patience, self.counters["best_val"])
            self.dist.load_model_state(self.model, self.checkpoints.best().load_weights())
        seconds = time.perf_counter() - started
        trained = self.step - first_step
        best = self.counters["best_val"]
        return TrainResult(self.step, first_step or None, self.history, seconds,
                           trained * self.tokens_per_step / seconds if seconds else 0.0,
                           self.counters["skipped"], best if math.isfinite(best) else None, stop)


def step_line(step: int, total: int, r: dict[str, float]) -> str:
    """`step 100/300 loss 4.1234 ppl 61.8 lr 1.20e-03 tok/s 12,345 [val 4.3000]`"""
    line = f"step {step}/{total} loss {r['train_loss']:.4f} ppl {math.exp(min(r['train_loss'], 50)):.1f} lr {r['lr']:.2e}"
    if "tokens_per_second" in r:
        line += f" tok/s {r['tokens_per_second']:,.0f} mfu {r['mfu']:.1%}"
    if "val_loss" in r:
        line += f" val {r['val_loss']:.4f}"
    return line
