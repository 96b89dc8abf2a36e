"""train.ema_horizon: an exponential moving average of the weights over a run's decaying steps.

At the end of a run the average is a candidate for the model: it is validated once and kept where it validates
better than the weights train.select picked. On the corpora measured (benchmarks/README.md, thirty-fourth session)
an average of the last steps scored 0.004-0.05 bits per byte better than the annealed weights it was taken over,
at equal steps and through the 2-minute plans, at every seed: the decay still leaves the step-to-step noise of
the last updates in the weights, which the average removes.

The average begins at the first step whose learning rate is below the peak after warmup (WSD: where its decay
begins; cosine and linear: after warmup; constant: never, so nothing is averaged). From there the run's steps
are fixed (a time budget re-plans only before, and train.decay_patience rewinds to a step before its decay), so a
run that takes the final step count from the start averages the same weights, bit for bit. Each update weighs the
newest weights by 1 / (horizon × max_steps): the horizon is a share of the run's steps.

The average lives in the trainer's state (state.pt, plain tensors keyed by parameter name), so a resumed run
carries on with the same average. It needs every rank to hold whole parameters: one process and DDP. Under FSDP
and DeepSpeed it is off (train.ema_horizon null) or refused (set).
"""

from __future__ import annotations

import torch

from ultrathink.config import TrainConfig
from ultrathink.config.schema import SHARDED_BACKENDS
from ultrathink.train.schedule import lr_factor

EMA_HORIZON = 0.08  # train.ema_horizon null (benchmarks/README.md: the thirty-fourth session)


def ema_horizon_for(horizon: float | None, backend: str) -> float:
    """train.ema_horizon as a run uses it: 0 (off) or the share of its steps the average spans."""
    if horizon is None:
        return 0.0 if backend in SHARDED_BACKENDS else EMA_HORIZON
    return horizon


def decaying(step: int, cfg: TrainConfig) -> bool:
    """Whether optimizer step `step` (0-based) ran below the peak learning rate, after warmup."""
    return step >= cfg.warmup_steps and lr_factor(step, cfg) < 1.0


class WeightAverage:
    """An exponential moving average of `model`'s trainable parameters over its decaying steps, in fp32 on their
    device; None until the first of those steps."""

    def __init__(self, model: torch.nn.Module, horizon: float):
        self.horizon = horizon
        trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self.names, self.params = [name for name, _ in trainable], [p for _, p in trainable]
        self.tensors: list[torch.Tensor] | None = None

    def weight(self, max_steps: int) -> float:
        """The share of the newest weights in each update: 1 over the horizon in steps (at least one)."""
        return 1.0 / max(1.0, self.horizon * max_steps)

    @torch.no_grad()
    def update(self, step: int, cfg: TrainConfig) -> None:
        """After optimizer step `step` (0-based) has been applied."""
        if not decaying(step, cfg):
            return
        current = [p.detach().float() for p in self.params]
        if self.tensors is None:
            self.tensors = [tensor.clone() for tensor in current]
        else:
            torch._foreach_lerp_(self.tensors, current, self.weight(cfg.max_steps))

    def state_dict(self) -> dict[str, torch.Tensor] | None:
        return None if self.tensors is None else {n: t.cpu() for n, t in zip(self.names, self.tensors)}

    def load_state_dict(self, state: dict[str, torch.Tensor] | None) -> None:
        if state is not None and sorted(state) != sorted(self.names):
            raise ValueError(f"the checkpoint's weight average has other parameters than the model "
                             f"({len(state)} against {len(self.names)})")
        devices = [p.device for p in self.params]
        self.tensors = None if state is None else [state[n].to(d) for n, d in zip(self.names, devices)]

    @torch.no_grad()
    def swap(self) -> None:
        """Exchange the model's weights and the average (call again to swap them back)."""
        for param, tensor in zip(self.params, self.tensors):
            held = param.detach().float().clone()
            param.copy_(tensor)
            tensor.copy_(held)
