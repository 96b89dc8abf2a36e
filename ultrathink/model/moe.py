"""Sparse mixture-of-experts MLP: token-choice top-k routing over SwiGLU experts.

A linear router scores every expert for each token; the token goes to its top_k experts and its output is their
outputs weighted by the router's softmax probabilities (renormalised over the chosen experts, as Mixtral does;
with top_k=1 the probability itself, as Switch does, so the router still gets a gradient from the loss). Only the
tokens routed to an expert run through it, so compute per token grows with top_k, not with the number of experts.

Balance is kept by a Switch load-balancing loss and a router z-loss (returned through `aux_loss`, added to the
model's training loss) and, optionally, by DeepSeek-V3's aux-loss-free bias: a per-expert offset added to the
scores used to *choose* experts (never to their weights), nudged after each optimizer step toward equal load.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from ultrathink.config import MoEConfig


def load_balance_loss(probs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's loss: E·Σᵢ fᵢ·Pᵢ, fᵢ the share of assignments to expert i and Pᵢ its mean router
    probability. 1 at perfect balance; E when every token goes to one expert with certainty."""
    share = counts.float() / counts.sum()
    return probs.shape[-1] * (share * probs.mean(0)).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's z-loss: mean squared log-partition of the router logits; keeps them small and the softmax stable."""
    return torch.logsumexp(logits, dim=-1).pow(2).mean()


@dataclass
class RoutingStats:
    """What one forward did: assignments each expert was chosen for, and how many of them it processed."""

    chosen: torch.Tensor  # (E,)
    processed: torch.Tensor  # (E,) chosen minus those dropped over capacity


class MoE(nn.Module):
    def __init__(self, d_model: int, cfg: MoEConfig, make_expert: Callable[[], nn.Module]):
        super().__init__()
        self.cfg, self.top_k = cfg, cfg.top_k
        self.router = nn.Linear(d_model, cfg.n_experts, bias=False)
        self.experts = nn.ModuleList(make_expert() for _ in range(cfg.n_experts))
        # Persistent: the bias is part of the trained model (it decides routing) and must survive a checkpoint.
        self.register_buffer("select_bias", torch.zeros(cfg.n_experts))
        self.register_buffer("step_load", torch.zeros(cfg.n_experts), persistent=False)
        self.aux_loss: torch.Tensor | None = None
        self.stats: RoutingStats | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        # Time-major order: capacity keeps earlier positions first, so whether a token is dropped never depends on
        # tokens after it (the model stays causal in training too).
        flat = x.transpose(0, 1).reshape(-1, d)
        logits = self.router(flat).float()
        probs = logits.softmax(dim=-1)
        choice = (probs + self.select_bias).topk(self.top_k, dim=-1).indices  # (N, top_k)
        weights = probs.gather(-1, choice)
        if self.top_k > 1:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        chosen = torch.bincount(choice.flatten(), minlength=len(self.experts))
        out, processed = self._dispatch(flat, choice, weights.to(flat.dtype), chosen, self._capacity(len(flat)))
        self.stats = RoutingStats(chosen, processed)
        self.aux_loss = None
        if self.training:
            self.aux_loss = (self.cfg.aux_loss_weight * load_balance_loss(probs, chosen)
                             + self.cfg.z_loss_weight * router_z_loss(logits))
            self.step_load += chosen
        return out.view(T, B, d).transpose(0, 1)

    def _capacity(self, n_tokens: int) -> int | None:
        """Most assignments one expert takes; None (dropless) at eval, so inference never drops a token."""
        if not self.training or self.cfg.capacity_factor is None:
            return None
        return math.ceil(self.cfg.capacity_factor * n_tokens * self.top_k / len(self.experts))

    def _dispatch(self, flat, choice, weights, chosen, capacity) -> tuple[torch.Tensor, torch.Tensor]:
        """Run each expert on the tokens routed to it (at most `capacity`), add the weighted outputs per token."""
        # Assignment a is token a // top_k's (a % top_k)-th choice; a stable sort groups them by expert, earliest first.
        by_expert = choice.flatten().argsort(stable=True).split(chosen.tolist())
        out = torch.zeros_like(flat)
        processed = torch.zeros_like(chosen)
        for e, assignments in enumerate(by_expert):
            assignments = assignments[:capacity]  # the rest are dropped: those tokens keep only their residual
            if len(assignments) == 0:
                continue
            tokens = assignments // self.top_k
            y = self.experts[e](flat[tokens]) * weights.flatten()[assignments, None]
            out.index_add_(0, tokens, y)
            processed[e] = len(assignments)
        return out, processed

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        """Aux-loss-free balancing: make overloaded experts less likely to be chosen, underloaded ones more."""
        if self.cfg.bias_balancing and self.step_load.sum() > 0:
            self.select_bias += self.cfg.bias_update_rate * torch.sign(self.step_load.mean() - self.step_load)
        self.step_load.zero_()


def normalized_entropy(counts: torch.Tensor) -> float:
    """Entropy of the load distribution over log(#experts): 1 = perfectly even, 0 = one expert takes everything."""
    share = counts.float() / counts.sum().clamp(min=1)
    entropy = -(share * share.clamp(min=1e-12).log()).sum()
    return (entropy / math.log(len(counts))).item() if len(counts) > 1 else 1.0


def _health(chosen: torch.Tensor, processed: torch.Tensor) -> dict[str, float]:
    total = chosen.sum().clamp(min=1)
    return {"entropy": normalized_entropy(chosen), "max_share": (chosen.max() / total).item(),
            "dead": float((processed == 0).sum()), "dropped": (1 - processed.sum() / total).item()}


def moe_metrics(layers: dict[int, MoE]) -> dict[str, float]:
    """Routing health of the last forward, per MoE layer (keyed by block index), per expert group (over all
    layers) and in summary. Empty before the first forward."""
    layers = {i: m for i, m in layers.items() if m.stats is not None}
    if not layers:
        return {}
    metrics, per_layer = {}, []
    for i, layer in layers.items():
        health = _health(layer.stats.chosen, layer.stats.processed)
        per_layer.append(health)
        metrics.update({f"moe/layer{i}/{k}": v for k, v in health.items()})
    chosen = torch.stack([m.stats.chosen for m in layers.values()])  # (layers, E)
    processed = torch.stack([m.stats.processed for m in layers.values()])
    start = 0
    for group, size in next(iter(layers.values())).cfg.groups.model_dump().items():
        part = slice(start, start + size)
        start += size
        if size:
            health = _health(chosen[:, part].sum(0), processed[:, part].sum(0))
            health["dead"] = float((processed[:, part] == 0).sum())  # per layer: an expert may live in one only
            health["share"] = (chosen[:, part].sum() / chosen.sum()).item()
            metrics.update({f"moe/{group}/{k}": v for k, v in health.items()})
    metrics["moe_entropy"] = sum(h["entropy"] for h in per_layer) / len(per_layer)
    metrics["moe_max_expert_share"] = max(h["max_share"] for h in per_layer)
    metrics["moe_dead_experts"] = sum(h["dead"] for h in per_layer)
    metrics["moe_dropped_frac"] = sum(h["dropped"] for h in per_layer) / len(per_layer)
    aux = [m.aux_loss for m in layers.values() if m.aux_loss is not None]
    if aux:
        metrics["moe_aux_loss"] = (sum(aux) / len(aux)).item()
    return metrics


def moe_aux_loss(layers: list[MoE]) -> torch.Tensor:
    """The weighted aux losses of the last training forward, averaged over layers so the weights mean the same at
    any depth."""
    return sum(m.aux_loss for m in layers) / len(layers)
