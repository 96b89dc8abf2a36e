"""The interface between the model and its routing variants (MoE: moe.py, DRE: dre.py).

A variant is a module that routes tokens and keeps some routing state (a buffer: MoE selection biases, DRE
thresholds) that moves between optimizer steps. It plugs in through `RoutingModule`:

- its forward returns `(output, records)`: what it computed besides its output, as values. A `Routing` record holds
  its weighted aux loss (training only) and its statistics (counts, sums: tensors that add up). Nothing is written
  to the module during forward, so a forward that is recomputed (activation checkpointing), thrown away (a skipped
  step) or run on another rank changes nothing by itself;
- `update(stats)` moves its state, given one optimizer step's statistics summed over micro-batches and ranks. The
  trainer calls it once per *applied* step, on every rank with the same (all-reduced) numbers, so every rank keeps
  the same routing state on every backend; a skipped step's statistics are dropped with it;
- `metrics(...)` and `line(...)` turn summed statistics into logged figures and the console's step-line suffix.

The model finds its variants through the module tree (`variants`), groups them by class, and knows nothing else
about them; records travel out of each block as its output, which keeps the aux losses visible to every wrapper
(FSDP and ZeRO-3 unshard a block's weights for backward from hooks on its outputs).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn

Stats = dict[str, torch.Tensor]  # one module's statistics: float64 tensors that are summed, never averaged


class Routing(NamedTuple):
    aux_loss: torch.Tensor | None  # already weighted by the variant's config; None outside training
    stats: Stats


Records = dict[str, Routing]  # per module, keyed by its name relative to whoever returns them
StepStats = dict[str, Stats]  # per module, keyed by its name in the model


class RoutingModule(nn.Module):
    """Base class of routing variants (see the module docstring)."""

    @classmethod
    def build(cls, cfg, layer: int, block: nn.Module) -> nn.Module:
        """Install this variant into block `layer` (cfg: the ModelConfig) where its section applies: replace a
        part of the block, or return a module that wraps it."""
        raise NotImplementedError

    def idle_params(self) -> int:
        """Parameters of this module a token's forward does not use (MoE: the experts it was not routed to)."""
        return 0

    def update(self, stats: Stats) -> None:
        """Move the routing state after an applied optimizer step, from that step's summed statistics."""
        raise NotImplementedError

    @classmethod
    def metrics(cls, modules: dict[str, tuple["RoutingModule", Stats]], model: nn.Module) -> dict[str, float]:
        """Logged figures for all modules of this class, from their summed statistics."""
        raise NotImplementedError

    @classmethod
    def line(cls, metrics: dict[str, float], modules: list["RoutingModule"]) -> str:
        """The console step-line part for this class, e.g. `moe=[entropy=0.97,max_exp=14.2%]`."""
        return ""


# A variant's config section class → the RoutingModule class that builds it (see `implements`).
_IMPLEMENTATIONS: dict[type, type[RoutingModule]] = {}


def implements(section: type):
    """Class decorator: `@implements(MoEConfig) class MoE(RoutingModule)` makes MoE the builder of every enabled
    model.moe section. The module defining a variant is imported where the model is (ultrathink/model/__init__.py)."""
    def register(cls: type[RoutingModule]) -> type[RoutingModule]:
        _IMPLEMENTATIONS[section] = cls
        return cls
    return register


def variant_classes(cfg) -> list[type[RoutingModule]]:
    """The RoutingModule classes of the variants `cfg` (a ModelConfig) enables."""
    missing = [type(s).__name__ for s in cfg.variants() if type(s) not in _IMPLEMENTATIONS]
    if missing:
        raise LookupError(f"no RoutingModule implements {', '.join(missing)}: decorate its class with "
                          "@routing.implements(<its config section>) and import its module with the model")
    return [_IMPLEMENTATIONS[type(section)] for section in cfg.variants()]


def count(value: float | int | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A statistic as a float64 tensor on `like`'s device (all-reduced with the others in one flat tensor)."""
    return torch.as_tensor(value, dtype=torch.float64, device=like.device)


def prefixed(prefix: str, records: Records) -> Records:
    """Records of a submodule, renamed relative to its parent (`prefix` is the submodule's attribute path)."""
    return {f"{prefix}.{name}" if name else prefix: record for name, record in records.items()}


def add(total: StepStats, new: StepStats) -> StepStats:
    """Sum statistics of two forwards (micro-batches of one step)."""
    if not total:
        return {name: dict(stats) for name, stats in new.items()}
    return {name: {k: v + new[name][k] for k, v in stats.items()} for name, stats in total.items()}


def flatten(stats: StepStats) -> tuple[torch.Tensor, list[tuple[str, str, torch.Size]]]:
    """All statistics as one float64 vector (one collective for all of them), in a fixed order, and its layout."""
    layout = [(name, key, stats[name][key].shape) for name in sorted(stats) for key in sorted(stats[name])]
    if not layout:
        return torch.zeros(0, dtype=torch.float64), layout
    return torch.cat([stats[n][k].double().flatten() for n, k, _ in layout]), layout


def unflatten(flat: torch.Tensor, layout: list[tuple[str, str, torch.Size]]) -> StepStats:
    out: StepStats = {}
    start = 0
    for name, key, shape in layout:
        size = shape.numel()
        out.setdefault(name, {})[key] = flat[start : start + size].view(shape)
        start += size
    return out


def block_index(name: str) -> int:
    """'blocks.3.mlp' → 3: the block a module lives in, for per-layer metric names."""
    return int(name.split(".")[1])


def numel(p: torch.Tensor) -> int:
    """A parameter's full size, also under ZeRO-3 (which leaves each rank an empty placeholder and `ds_numel`)."""
    return getattr(p, "ds_numel", None) or p.numel()
