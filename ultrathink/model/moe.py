"""Sparse mixture-of-experts MLP: token-choice top-k routing over SwiGLU experts.

A linear router scores every expert for each token; the token goes to its top_k experts and its output is their
outputs weighted by the router's softmax probabilities (renormalised over the chosen experts, as Mixtral does;
with top_k=1 the probability itself, as Switch does, so the router still gets a gradient from the loss). Only the
tokens routed to an expert run through it, so compute per token grows with top_k, not with the number of experts.

Balance is kept by a Switch load-balancing loss and a router z-loss (returned with the forward's record, added to
the model's training loss) and, optionally, by DeepSeek-V3's aux-loss-free bias: a per-expert offset added to the
scores used to *choose* experts (never to their weights), nudged after each applied optimizer step toward equal
load (`update`, from the step's expert loads summed over micro-batches and ranks).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn

from ultrathink.config import MoEConfig
from ultrathink.model.routing import Records, Routing, RoutingModule, implements, Stats, block_index, count, numel
from ultrathink.model.model import SwiGLU


ROWS_MULTIPLE = 32  # each expert's tokens are padded to a multiple of this many rows (see _dispatch)


def load_balance_loss(probs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's loss: E·Σᵢ fᵢ·Pᵢ, fᵢ the share of assignments to expert i and Pᵢ its mean router
    probability. 1 at perfect balance; E when every token goes to one expert with certainty."""
    share = counts.float() / counts.sum()
    return probs.shape[-1] * (share * probs.mean(0)).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's z-loss: mean squared log-partition of the router logits; keeps them small and the softmax stable."""
    return torch.logsumexp(logits, dim=-1).pow(2).mean()


@implements(MoEConfig)
class MoE(RoutingModule):
    def __init__(self, d_model: int, cfg: MoEConfig, make_expert: Callable[[], nn.Module]):
        super().__init__()
        self.cfg, self.top_k = cfg, cfg.top_k
        self.router = nn.Linear(d_model, cfg.n_experts, bias=False)
        self.experts = nn.ModuleList(make_expert() for _ in range(cfg.n_experts))
        # Persistent: the bias is part of the trained model (it decides routing) and must survive a checkpoint.
        self.register_buffer("select_bias", torch.zeros(cfg.n_experts))
        self.expert_params = sum(numel(p) for p in self.experts[0].parameters())  # before any sharding

    @classmethod
    def build(cls, cfg, layer: int, block: nn.Module) -> nn.Module:
        """The block's MLP becomes a mixture of SwiGLU experts."""
        if cfg.moe.applies_to(layer):
            hidden = cfg.moe.expert_hidden or cfg.hidden
            block.mlp = cls(cfg.d_model, cfg.moe, lambda: SwiGLU(cfg.d_model, hidden))
        return block

    def idle_params(self) -> int:
        return self.expert_params * (len(self.experts) - self.top_k)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Records]:
        """(B, T, d) → (B, T, d), and this forward's record: `chosen` (assignments each expert was chosen for),
        `processed` (those it ran: chosen minus the ones dropped over capacity), and the aux loss."""
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
        aux = None
        if self.training:
            aux = (self.cfg.aux_loss_weight * load_balance_loss(probs, chosen)
                   + self.cfg.z_loss_weight * router_z_loss(logits))
        stats = {"chosen": chosen.double(), "processed": processed.double(), "forwards": count(1, flat),
                 "aux_loss": count(0 if aux is None else aux.detach(), flat)}
        return out.view(T, B, d).transpose(0, 1), {"": Routing(aux, stats)}

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
            # An expert with no tokens still runs (on none): its weights get a zero gradient rather than none, so
            # every rank's backward produces the same set of gradients (DDP's reducer and ZeRO count on it).
            tokens = assignments // self.top_k
            rows = flat[tokens]
            # Zero rows up to a multiple of ROWS_MULTIPLE: expert loads change every step, and on a CPU a matmul of
            # a new shape costs a kernel setup (oneDNN) about twice the matmul itself.
            padded = torch.cat([rows, rows.new_zeros(-len(rows) % ROWS_MULTIPLE, rows.shape[1])])
            y = self.experts[e](padded)[: len(rows)] * weights.flatten()[assignments, None]
            out.index_add_(0, tokens, y)
            processed[e] = len(assignments)
        return out, processed

    @torch.no_grad()
    def update(self, stats: Stats) -> None:
        """Aux-loss-free balancing: make overloaded experts less likely to be chosen, underloaded ones more."""
        load = stats["chosen"].to(self.select_bias)
        if self.cfg.bias_balancing and load.sum() > 0:
            self.select_bias += self.cfg.bias_update_rate * torch.sign(load.mean() - load)

    @classmethod
    def metrics(cls, modules: dict[str, tuple["MoE", Stats]], model: nn.Module) -> dict[str, float]:
        return moe_metrics({block_index(name): (m.cfg, stats) for name, (m, stats) in modules.items()})

    @classmethod
    def line(cls, metrics: dict[str, float], modules: list["MoE"]) -> str:
        return f"moe=[entropy={metrics['moe_entropy']:.2f},max_exp={metrics['moe_max_expert_share']:.1%}]"


def normalized_entropy(counts: torch.Tensor) -> float:
    """Entropy of the load distribution over log(#experts): 1 = perfectly even, 0 = one expert takes everything."""
    share = counts.float() / counts.sum().clamp(min=1)
    entropy = -(share * share.clamp(min=1e-12).log()).sum()
    return (entropy / math.log(len(counts))).item() if len(counts) > 1 else 1.0


def _health(chosen: torch.Tensor, processed: torch.Tensor) -> dict[str, float]:
    total = chosen.sum().clamp(min=1)
    return {"entropy": normalized_entropy(chosen), "max_share": (chosen.max() / total).item(),
            "dead": float((processed == 0).sum()), "dropped": (1 - processed.sum() / total).item()}


def moe_metrics(layers: dict[int, tuple[MoEConfig, Stats]]) -> dict[str, float]:
    """Routing health from summed statistics, per MoE layer (keyed by block index), per expert group (over all
    layers) and in summary."""
    metrics, per_layer = {}, []
    for i, (_, stats) in layers.items():
        health = _health(stats["chosen"], stats["processed"])
        per_layer.append(health)
        metrics.update({f"moe/layer{i}/{k}": v for k, v in health.items()})
    chosen = torch.stack([stats["chosen"] for _, stats in layers.values()])  # (layers, E)
    processed = torch.stack([stats["processed"] for _, stats in layers.values()])
    start = 0
    for group, size in next(iter(layers.values()))[0].groups.model_dump().items():
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
    aux = [stats["aux_loss"] / stats["forwards"] for _, stats in layers.values()]
    metrics["moe_aux_loss"] = (sum(aux) / len(aux)).item()
    return metrics
