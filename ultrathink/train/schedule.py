"""Learning-rate schedules: linear warmup, then cosine, linear, constant or warmup-stable-decay (WSD).

The scheduler's whole state is the peak lr of each group and the step, so a checkpoint restores it exactly.
"""

from __future__ import annotations

import math

import torch

from ultrathink.config import TrainConfig


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based)."""
    warmup, total, floor = cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if cfg.schedule == "cosine":
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    if cfg.schedule == "linear":
        return floor + (1 - floor) * (1 - progress)
    if cfg.schedule == "constant":
        return 1.0
    # wsd: hold the peak, then decay linearly over the last decay_fraction of training.
    decay_start = 1 - cfg.decay_fraction
    if progress <= decay_start:
        return 1.0
    return floor + (1 - floor) * (1 - (progress - decay_start) / cfg.decay_fraction)


def decay_from(step: int, cfg: TrainConfig) -> int:
    """The max_steps under which a WSD run's decay begins after optimizer step `step`: the decay then takes
    decay_fraction of the run, as it would have at the end of the planned one."""
    total = cfg.warmup_steps + math.ceil((step - cfg.warmup_steps) / (1 - cfg.decay_fraction))
    while not same_schedule(cfg, total, step):  # lr_factor's rounding may put the start one step early
        total += 1
    return total


def same_schedule(cfg: TrainConfig, max_steps: int, step: int) -> bool:
    """Whether steps 0..step (the next one's rate is already set) have the same rates with `max_steps` as with
    cfg.max_steps: what a time budget's revision of its steps must keep (trainer.py, Deadline)."""
    revised = cfg.model_copy(update={"max_steps": max_steps})
    return max_steps > step and all(lr_factor(s, cfg) == lr_factor(s, revised) for s in range(step + 1))


class Scheduler:
    """Sets each param group's lr to peak × lr_factor(step) across one or more optimizers."""

    def __init__(self, optimizers: list[torch.optim.Optimizer], cfg: TrainConfig):
        self.optimizers, self.cfg, self.step_count = optimizers, cfg, 0
        self.peaks = [g["lr"] for g in self.groups()]
        self._apply()

    def groups(self) -> list[dict]:
        # Looked up each time: Optimizer.load_state_dict replaces its param_group dicts.
        return [g for opt in self.optimizers for g in opt.param_groups]

    def _apply(self) -> None:
        factor = lr_factor(self.step_count, self.cfg)
        for group, peak in zip(self.groups(), self.peaks):
            group["lr"] = peak * factor

    def revise(self, cfg: TrainConfig) -> None:
        """Another max_steps for the rest of the run (a time budget re-planned)."""
        self.cfg = cfg
        self._apply()

    def step(self) -> None:
        self.step_count += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [g["lr"] for g in self.groups()]

    def state_dict(self) -> dict:
        return {"step_count": self.step_count, "peaks": list(self.peaks)}

    def load_state_dict(self, state: dict) -> None:
        self.step_count, self.peaks = int(state["step_count"]), [float(p) for p in state["peaks"]]
        self._apply()
