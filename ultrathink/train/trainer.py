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
from ultrathink.train.checkpoint import CheckpointManager
from ultrathink.train.loader import TokenWindows, eval_batches
from ultrathink.train.optim import build_optimizer
from ultrathink.train.precision import resolve_precision
from ultrathink.train.schedule import build_scheduler

log = logging.getLogger(__name__)

MetricsSink = Callable[[dict[str, float], int], None]


def autocast(precision: str, device: str = "cpu"):
    if resolve_precision(precision, device) == "bf16":
        return torch.autocast(device_type=device, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def mean_loss(model, batches, precision: str) -> tuple[float, int]:
    """Mean next-token loss over `batches` and the number of predicted tokens."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for x, y in batches:
        with autocast(precision):
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


class Trainer:
    def __init__(self, model: torch.nn.Module, train_loader: TokenWindows, val_tokens: np.ndarray,
                 cfg: TrainConfig, checkpoints: CheckpointManager, fingerprint: str,
                 log_metrics: MetricsSink | None = None):
        self.model, self.loader, self.val_tokens, self.cfg = model, train_loader, val_tokens, cfg
        self.checkpoints, self.fingerprint = checkpoints, fingerprint
        self.log_metrics = log_metrics or (lambda metrics, step: None)
        self.optimizer = build_optimizer(model, cfg)
        self.scheduler = build_scheduler(self.optimizer, cfg)
        self.step = 0
        self.history: list[dict[str, float]] = []
        self.tokens_per_step = cfg.batch_size * cfg.grad_accum * train_loader.seq_len

    # ---- checkpoint state -------------------------------------------------------------------------------------
    def state(self) -> dict:
        return {
            "step": self.step,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "loader": self.loader.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "history": self.history,
        }

    def resume(self) -> int | None:
        """Continue from the latest intact checkpoint made with the same config; otherwise start clean."""
        latest = self.checkpoints.latest()
        if latest is None:
            return None
        if not self.cfg.resume or latest.fingerprint != self.fingerprint:
            why = "train.resume is false" if not self.cfg.resume else "its config differs from this run's"
            log.warning("not resuming from %s: %s; starting fresh", latest.path, why)
            self.checkpoints.clear()
            return None
        state = latest.load_state()
        self.model.load_state_dict(latest.load_weights())
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.loader.load_state_dict(state["loader"])
        torch.set_rng_state(state["torch_rng"])
        self.step, self.history = state["step"], state["history"]
        log.warning("resumed from %s at step %d", latest.path, self.step)
        return self.step

    # ---- the loop -------------------------------------------------------------------------------------------
    def train_step(self) -> tuple[float, float]:
        """One optimizer step over grad_accum micro-batches; returns (mean loss, gradient norm before clipping)."""
        self.model.train()
        total = 0.0
        for _ in range(self.cfg.grad_accum):
            x, y = next(self.loader)
            with autocast(self.cfg.precision):
                _, loss = self.model(x, y)
            (loss / self.cfg.grad_accum).backward()
            total += loss.item() / self.cfg.grad_accum
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm).item()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return total, grad_norm

    def validate(self) -> float:
        batches = eval_batches(self.val_tokens, self.loader.seq_len, self.cfg.batch_size, self.cfg.eval_batches)
        return mean_loss(self.model, batches, self.cfg.precision)[0]

    def fit(self) -> TrainResult:
        """Train up to cfg.max_steps from the current step (call resume() first to continue a checkpoint)."""
        cfg, first_step = self.cfg, self.step
        started, window_start, window_steps = time.perf_counter(), time.perf_counter(), 0
        bar = tqdm(total=cfg.max_steps, initial=self.step, desc="train", unit="step", disable=None, leave=False)
        while self.step < cfg.max_steps:
            loss, grad_norm = self.train_step()
            window_steps += 1
            bar.update(1)
            record = {"train_loss": loss, "lr": self.scheduler.get_last_lr()[0], "grad_norm": grad_norm}
            last = self.step == cfg.max_steps
            if self.step % cfg.log_every == 0 or last:
                elapsed = time.perf_counter() - window_start
                record["tokens_per_second"] = window_steps * self.tokens_per_step / elapsed
                window_start, window_steps = time.perf_counter(), 0
            if self.step % cfg.eval_every == 0 or last:
                record["val_loss"] = self.validate()
            if "tokens_per_second" in record or "val_loss" in record:
                self.history.append({"step": self.step, **record})
                self.log_metrics(record, self.step)
                bar.write(step_line(self.step, cfg.max_steps, record))
            if self.step % cfg.checkpoint_every == 0 or last:
                self.checkpoints.save(self.step, self.fingerprint, self.model, self.state())
        bar.close()
        seconds = time.perf_counter() - started
        trained = self.step - first_step
        return TrainResult(self.step, first_step or None, self.history, seconds,
                           trained * self.tokens_per_step / seconds if seconds else 0.0)


def step_line(step: int, total: int, r: dict[str, float]) -> str:
    """`step 100/300 loss 4.1234 ppl 61.8 lr 1.20e-03 tok/s 12,345 [val 4.3000]`"""
    line = f"step {step}/{total} loss {r['train_loss']:.4f} ppl {math.exp(min(r['train_loss'], 50)):.1f} lr {r['lr']:.2e}"
    if "tokens_per_second" in r:
        line += f" tok/s {r['tokens_per_second']:,.0f}"
    if "val_loss" in r:
        line += f" val {r['val_loss']:.4f}"
    return line
