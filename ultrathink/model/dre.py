"""Dynamic Reasoning Engine: Mixture-of-Depths token routing (Raposo et al., 2024).

In a routed block a linear router scores every token; only the selected tokens go through the block (attention
among the selected tokens, then the MLP) and the others pass along the residual unchanged. A selected token's
block output is scaled by sigmoid(score): that product is how the router gets its gradient.

Causality: MoD picks the top-k scores of the whole sequence, so whether token t is processed depends on later
tokens, which generation cannot know. Here a token is selected when its score exceeds a threshold, in training and
at inference alike, so a decision depends only on the token's own residual (itself a function of earlier tokens).
The thresholds are buffers: after each optimizer step they move toward the (1 − capacity) quantile of the scores
seen in that step's training forwards (one threshold per path preset), so each preset keeps about its share of
tokens on the training distribution. An optimizer moves the router faster than a running quantile can follow, so
an auxiliary loss (MoD's own, §3.5) anchors the scores: binary cross-entropy of (score − threshold) against "is
among the top capacity·T scores of its sequence" — a label only, never a routing decision. For the first
`warmup_steps` steps every token goes through the block (capacity 1) while that loss already shapes the router.

Rows of a batch select different numbers of tokens. Each row's selected tokens are gathered in position order and
padded to the longest row with some of its unselected tokens; those slots take the key position HIDDEN, so the
mask "key position ≤ query position" hides them from every real token, in the batch and later in the KV cache.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ultrathink.config import DREConfig

PATHS = {"fast": 0.25, "standard": 0.5, "deep": 0.75}
CAPACITIES = torch.tensor(list(PATHS.values()))
THRESHOLD_EMA = 0.5  # share of the newly observed quantile taken per step (the aux loss keeps the drift small)
HIDDEN = torch.iinfo(torch.long).max  # key position of padding slots: after every real query


class RoutedBlock(nn.Module):
    def __init__(self, block: nn.Module, d_model: int, cfg: DREConfig):
        super().__init__()
        self.block, self.cfg = block, cfg
        self.router = nn.Linear(d_model, 1, bias=False)
        # Persistent: thresholds and the step count decide routing, so checkpoints and saved models carry them.
        self.register_buffer("thresholds", torch.zeros(len(PATHS)))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("step_quantiles", torch.zeros(len(PATHS)), persistent=False)
        self.register_buffer("step_batches", torch.zeros((), dtype=torch.long), persistent=False)
        self.aux_loss: torch.Tensor | None = None  # weighted router loss of the last training forward
        self.kept: float | None = None  # share of tokens the last forward sent through the block
        self.computed: float | None = None  # share of token slots it computed (kept + padding)

    def path(self) -> str | None:
        """The path preset routing uses now; None while warming up (every token goes through)."""
        if not self.training and self.cfg.force_path is not None:
            return self.cfg.force_path
        return self.cfg.path if self.steps >= self.cfg.warmup_steps else None

    def forward(self, x, cos, sin, cache=None) -> torch.Tensor:
        scores = self.router(x).squeeze(-1).float()  # (B, T)
        self.aux_loss = self._router_loss(scores) if self.training else None
        path = self.path()
        if path is None:
            self.kept = self.computed = 1.0
            return self.block(x, cos, sin, cache)
        selected = scores.detach() > self.thresholds[list(PATHS).index(path)]
        B, T, d = x.shape
        width = int(selected.sum(dim=1).max())
        self.kept, self.computed = selected.float().mean().item(), width / T
        if width == 0:
            return x
        position = torch.arange(T, device=x.device).expand(B, T)
        # Per row: the selected positions in order, then unselected ones as padding up to `width`.
        order = torch.where(selected, position, position + T).argsort(dim=1)[:, :width]
        picked = selected.gather(1, order)
        start = cache.length if cache is not None else 0
        query_pos = torch.where(picked, order + start, HIDDEN)
        key_pos = query_pos
        if cache is not None:
            past = cache.positions[self.block.layer]
            key_pos = query_pos if past is None else torch.cat([past, query_pos], dim=1)
            cache.positions[self.block.layer] = key_pos
        mask = (key_pos[:, None, :] <= query_pos[:, :, None]).unsqueeze(1)  # (B, 1, width, keys)
        index = order[..., None].expand(-1, -1, d)
        xs = x.gather(1, index)
        out = self.block(xs, cos[order].unsqueeze(1), sin[order].unsqueeze(1), cache, mask)
        weight = torch.sigmoid(scores.gather(1, order)) * picked
        return x.scatter_add(1, index, (out - xs) * weight[..., None].to(x.dtype))

    def _router_loss(self, scores: torch.Tensor) -> torch.Tensor:
        """Record this batch's score quantiles and return the weighted BCE that keeps the trained path's threshold
        at its capacity."""
        self.step_quantiles += torch.quantile(scores.detach().flatten(), 1 - CAPACITIES.to(scores.device))
        self.step_batches += 1
        k = math.ceil(PATHS[self.cfg.path] * scores.shape[1])
        in_top = torch.zeros_like(scores).scatter(1, scores.detach().topk(k, dim=1).indices, 1.0)
        threshold = self.thresholds[list(PATHS).index(self.cfg.path)]
        return self.cfg.aux_loss_weight * F.binary_cross_entropy_with_logits(scores - threshold, in_top)

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        """Count the step and move the thresholds toward this step's observed quantiles."""
        if self.step_batches > 0:
            observed = self.step_quantiles / self.step_batches
            # The first observation replaces the arbitrary initial 0 outright.
            self.thresholds.lerp_(observed, 1.0 if self.steps == 0 else THRESHOLD_EMA)
            self.step_quantiles.zero_()
            self.step_batches.zero_()
        self.steps += 1


def dre_aux_loss(blocks: list[RoutedBlock]) -> torch.Tensor:
    return sum(b.aux_loss for b in blocks) / len(blocks)


def dre_metrics(blocks: dict[int, RoutedBlock], flops_per_token: int, d_model: int, seq_len: int) -> dict[str, float]:
    """Share of tokens each routed block (keyed by block index) processed in the last forward, and the FLOPs per
    token that forward spent relative to the same model run dense (padding slots count as spent)."""
    blocks = {i: b for i, b in blocks.items() if b.kept is not None}
    if not blocks:
        return {}
    metrics = {f"dre/layer{i}/kept": b.kept for i, b in blocks.items()}
    saved = 0.0
    for b in blocks.values():
        params = sum(p.numel() for p in b.block.parameters())
        # Weights: 6 FLOPs per parameter per token; attention scores and values: 12·d·T per token, and a routed
        # block's queries see only the selected keys, hence the square.
        saved += 6 * params * (1 - b.computed) + 12 * d_model * seq_len * (1 - b.computed**2)
    metrics["dre_kept"] = sum(b.kept for b in blocks.values()) / len(blocks)
    metrics["dre_flops_ratio"] = 1 - saved / flops_per_token
    return metrics
