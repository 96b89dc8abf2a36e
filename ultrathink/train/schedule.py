"""Learning-rate schedule: linear warmup, then cosine decay to min_lr_ratio·lr at max_steps."""

from __future__ import annotations

import functools
import math

import torch

from ultrathink.config import TrainConfig


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    factor = functools.partial(lr_factor, warmup=cfg.warmup_steps, total=cfg.max_steps, min_ratio=cfg.min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
