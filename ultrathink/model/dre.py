"""Dynamic Reasoning Engine: Mixture-of-Depths token routing (Raposo et al., 2024).

In a routed block a linear router scores every token; only the selected tokens go through the block (attention
among the selected tokens, then the MLP) and the others pass along the residual unchanged. A selected token's
block output is scaled by sigmoid(score): that product is how the router gets its gradient.

Causality: MoD picks the top-k scores of the whole sequence, so whether token t is processed depends on later
tokens, which generation cannot know. Here a token is selected when its score exceeds a threshold, in training and
at inference alike, so a decision depends only on the token's own residual (itself a function of earlier tokens).
The thresholds are buffers: after each applied optimizer step they move toward the (1 − capacity) quantiles of the
scores seen in that step's training forwards, averaged over micro-batches and ranks (`update`; one threshold per
path preset), so each preset keeps about its share of tokens on the training distribution. An optimizer moves the
router faster than a running quantile can follow, so an auxiliary loss (MoD's own, §3.5) anchors the scores: binary
cross-entropy of (score − threshold) against "is among the top capacity·T scores of its sequence" — a label only,
never a routing decision. For the first `warmup_steps` steps every token goes through the block (capacity 1) while
that loss already shapes the router.

Compute follows the kept tokens, not the longest row: the MLP runs on exactly the kept tokens of the whole batch
(one flat set, no padding). Attention needs rows: each row's kept tokens are gathered in position order and padded
to the row with the most with some of its unselected tokens, which sit after every kept token of the row. So in
training and scoring (no KV cache) plain causal attention over the gathered rows is exact: a kept token sees the
kept tokens before it, never a padding slot, and the fused causal kernel applies. With a KV cache (generation) the
padding slots take the key position HIDDEN and an explicit mask "key position ≤ query position" hides them from
every real token, in the batch and later in the cache.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ultrathink.config import DREConfig
from ultrathink.model.model import matmul_dtype
from ultrathink.model.routing import Records, Routing, RoutingModule, implements, Stats, block_index, count, numel, prefixed

PATHS = {"fast": 0.25, "standard": 0.5, "deep": 0.75}
CAPACITIES = torch.tensor(list(PATHS.values()))
THRESHOLD_EMA = 0.5  # share of the newly observed quantile taken per step (the aux loss keeps the drift small)
HIDDEN = torch.iinfo(torch.long).max  # key position of padding slots: after every real query
ATTENTION_GROUPS = 4  # groups of rows with similar kept counts, each padded to its own longest row
ROWS_MULTIPLE = 64  # the flat set of kept tokens is padded to a multiple of this many rows (see _route)


@implements(DREConfig)
class RoutedBlock(RoutingModule):
    def __init__(self, block: nn.Module, d_model: int, cfg: DREConfig):
        super().__init__()
        self.block, self.cfg = block, cfg
        self.router = nn.Linear(d_model, 1, bias=False)
        # Persistent: thresholds and the step count decide routing, so checkpoints and saved models carry them.
        self.register_buffer("thresholds", torch.zeros(len(PATHS)))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        # Counted before any sharding (ZeRO-3 leaves each rank an empty placeholder): the FLOPs a kept token costs.
        self.attn_params = sum(numel(p) for p in block.attn.parameters())
        self.mlp_params = sum(numel(p) for p in block.mlp.parameters())

    @classmethod
    def build(cls, cfg, layer: int, block: nn.Module) -> nn.Module:
        """The whole block is routed: wrapped, with its own router."""
        return cls(block, cfg.d_model, cfg.dre) if cfg.dre.applies_to(layer) else block

    def path(self) -> str | None:
        """The path preset routing uses now; None while warming up (every token goes through)."""
        if not self.training and self.cfg.force_path is not None:
            return self.cfg.force_path
        return self.cfg.path if self.steps >= self.cfg.warmup_steps else None

    def forward(self, x, cos, sin, cache=None) -> tuple[torch.Tensor, Records]:
        """(B, T, d) → (B, T, d) and the records of this block and of what runs inside it. Statistics: tokens
        seen and kept, rows the block's weights ran on, attention query slots and query·key pairs computed (padding
        included; dense_pairs: what the dense block would compute), and in training the score quantiles the
        thresholds move toward."""
        B, T, d = x.shape
        scores = self.router(x).squeeze(-1).float()  # (B, T)
        stats = {"forwards": count(1, x), "tokens": count(B * T, x), "dense_pairs": count(B * T * T, x)}
        aux = None
        if self.training:
            stats["quantiles"] = torch.quantile(scores.detach().flatten(), 1 - CAPACITIES.to(x.device)).double()
            aux = self._router_loss(scores)
        path = self.path()
        if path is None:
            out, inner = self.block(x, cos, sin, cache)
            stats.update(kept=count(B * T, x), rows=count(B * T, x), slots=count(B * T, x), pairs=count(B * T * T, x),
                         routed=count(0, x))
            return out, {"": Routing(aux, stats), **prefixed("block", inner)}
        selected = scores.detach() > self.thresholds[list(PATHS).index(path)]
        route = self._route if cache is None else self._route_cached
        out, inner, rows, slots, pairs = route(x, scores, selected, cos, sin, cache)
        stats.update(kept=selected.sum().double(), rows=count(rows, x), slots=count(slots, x), pairs=count(pairs, x),
                     routed=count(1, x))
        return out, {"": Routing(aux, stats), **prefixed("block", inner)}

    def _route(self, x, scores, selected, cos, sin, cache=None) -> tuple[torch.Tensor, Records, int, int, int]:
        """Training and scoring: the block on the kept tokens only. Returns the output, the inner records, the rows
        the norms, projections and MLP ran on, and the attention query slots and query·key pairs computed.

        The kept tokens of the whole batch form one flat set: the norms, projections and MLP run on exactly them.
        Only the attention scores need rows: rows that keep similar numbers of tokens are grouped, and each group's
        rows are padded to its own longest. Padding sits after a row's kept tokens, so causal attention over the
        group hides it from them, and its outputs are never read."""
        B, T, d = x.shape
        # At least one token is computed, even when none is kept (with weight 0): the block's weights then get a
        # zero gradient rather than none, so every rank's backward produces the same gradients (DDP, ZeRO).
        computed = selected.clone()
        computed.view(-1)[0] |= not bool(selected.any())
        counts = computed.sum(dim=1)
        position = torch.arange(T, device=x.device)
        tokens, groups, start = [], [], 0
        for rows in counts.argsort(descending=True).tensor_split(min(B, ATTENTION_GROUPS)):
            width = int(counts[rows].max())
            if width == 0:
                continue
            keep = computed[rows]
            order = torch.where(keep, position, position + T).argsort(dim=1)[:, :width]  # kept first, in order
            picked = keep.gather(1, order).flatten()
            tokens.append((rows[:, None] * T + order).flatten()[picked])
            # Each slot's place in the flat set (padding slots borrow the group's first token: never attended to).
            place = torch.full_like(picked, start, dtype=torch.long)
            place[picked] = torch.arange(start, start + int(picked.sum()), device=x.device)
            groups.append((len(rows), width, place, picked.nonzero().squeeze(1)))
            start += int(picked.sum())
        tokens = torch.cat(tokens)  # (computed,) indices into the B·T tokens, group by group, row by row
        n = len(tokens)
        attn, block = self.block.attn, self.block
        xk = x.flatten(0, 1).index_select(0, tokens)
        # The flat set is padded with zero rows to a multiple of ROWS_MULTIPLE: a matmul of a new shape costs a
        # new kernel setup on a CPU (oneDNN; about 2× the matmul itself), and kept counts change every step.
        padding = xk.new_zeros(-n % ROWS_MULTIPLE, d)
        at = tokens % T  # each kept token's position in its row
        q, k, v = attn.project(block.attn_norm(torch.cat([xk, padding]), matmul_dtype(xk)),
                               torch.cat([cos[at], cos[:1].expand(len(padding), -1)]),
                               torch.cat([sin[at], sin[:1].expand(len(padding), -1)]))
        qkv, mixed = torch.cat([q, k, v], dim=1), []  # (rows, heads + 2·kv_heads, head_dim): one gather per group
        for rows, width, place, real in groups:
            q_g, k_g, v_g = qkv.index_select(0, place).view(rows, width, *qkv.shape[1:]).transpose(1, 2).split(
                [q.shape[1], k.shape[1], v.shape[1]], dim=1)
            y = attn.mix(q_g, k_g, v_g, causal=width > 1).transpose(1, 2).flatten(0, 1)
            mixed.append(y.index_select(0, real))
        mixed = torch.cat([torch.cat(mixed).flatten(1), padding.new_zeros(len(padding), q.shape[1] * q.shape[2])])
        h = torch.cat([xk, padding]) + block.drop(attn.o_proj(mixed))
        fed, inner = block.feed(h[None])
        weight = torch.sigmoid(scores.flatten().index_select(0, tokens)) * selected.flatten()[tokens]
        update = (h[:n] + fed[0, :n] - xk) * weight[:, None].to(xk.dtype)
        delta = torch.zeros_like(x).flatten(0, 1).index_copy(0, tokens, update.to(x.dtype)).view_as(x)
        slots = sum(rows * width for rows, width, _, _ in groups)
        pairs = sum(rows * width**2 for rows, width, _, _ in groups)
        return x + delta, inner, len(h), slots, pairs  # a new tensor, not a view: FSDP hooks it for backward

    def _route_cached(self, x, scores, selected, cos, sin, cache) -> tuple[torch.Tensor, Records, int, int, int]:
        """Generation: every row's selected tokens gathered in order and padded to the longest row, since the KV
        cache holds all rows; padding slots get key position HIDDEN, which the mask hides from every real query."""
        B, T, d = x.shape
        position = torch.arange(T, device=x.device).expand(B, T)
        width = max(1, int(selected.sum(dim=1).max()))
        order = torch.where(selected, position, position + T).argsort(dim=1)[:, :width]  # (B, width)
        picked = selected.gather(1, order)
        index = order[..., None].expand(-1, -1, d)
        xs = x.gather(1, index)
        mask = self._cache_mask(order, picked, cache)
        h = xs + self.block.attend(xs, cos[order], sin[order], cache, mask)
        fed, inner = self.block.feed(h[picked][None])
        y = h.index_put((picked,), fed[0].to(h.dtype), accumulate=True)
        weight = torch.sigmoid(scores.gather(1, order)) * picked  # padding slots add nothing
        out = x.scatter_add(1, index, (y - xs) * weight[..., None].to(x.dtype))
        return out, inner, B * width, B * width, B * width**2

    def _cache_mask(self, order, picked, cache) -> torch.Tensor:
        """Generation: positions of this chunk's slots appended to the cached ones; padding slots are HIDDEN."""
        query_pos = torch.where(picked, order + cache.length, HIDDEN)
        past = cache.positions[self.block.layer]
        key_pos = query_pos if past is None else torch.cat([past, query_pos], dim=1)
        cache.positions[self.block.layer] = key_pos
        return (key_pos[:, None, :] <= query_pos[:, :, None]).unsqueeze(1)  # (B, 1, width, keys)

    def _router_loss(self, scores: torch.Tensor) -> torch.Tensor:
        """The weighted BCE that keeps the trained path's threshold at its capacity."""
        k = math.ceil(PATHS[self.cfg.path] * scores.shape[1])
        in_top = torch.zeros_like(scores).scatter(1, scores.detach().topk(k, dim=1).indices, 1.0)
        threshold = self.thresholds[list(PATHS).index(self.cfg.path)]
        return self.cfg.aux_loss_weight * F.binary_cross_entropy_with_logits(scores - threshold, in_top)

    @torch.no_grad()
    def update(self, stats: Stats) -> None:
        """Count the step and move the thresholds toward this step's observed quantiles."""
        observed = (stats["quantiles"] / stats["forwards"]).to(self.thresholds)
        if torch.isfinite(observed).all():
            # The first observation replaces the arbitrary initial 0 outright.
            self.thresholds.lerp_(observed, 1.0 if self.steps == 0 else THRESHOLD_EMA)
        self.steps += 1

    @classmethod
    def metrics(cls, modules: dict[str, tuple["RoutedBlock", Stats]], model: nn.Module) -> dict[str, float]:
        """Share of tokens each routed block (by block index) processed, and the FLOPs per token spent relative
        to the same model run dense: weights count for the rows they ran on (kept tokens and padding rows),
        attention scores for the query·key pairs computed (padding included)."""
        d, T = model.cfg.d_model, model.cfg.seq_len
        metrics, saved = {}, 0.0
        for name, (block, s) in modules.items():
            tokens = s["tokens"].item()
            metrics[f"dre/layer{block_index(name)}/kept"] = s["kept"].item() / tokens
            metrics[f"dre/layer{block_index(name)}/attention_slots"] = s["slots"].item() / tokens
            saved += (6 * (block.attn_params + block.mlp_params) * (1 - s["rows"].item() / tokens)
                      + 12 * d * T * (1 - s["pairs"].item() / s["dense_pairs"].item()))
        kept = [v for k, v in metrics.items() if k.endswith("/kept")]
        metrics["dre_kept"] = sum(kept) / len(kept)
        metrics["dre_flops_ratio"] = 1 - saved / model.flops_per_token()
        metrics["dre_routed"] = min(s["routed"].item() / s["forwards"].item() for _, s in modules.values())
        return metrics

    @classmethod
    def line(cls, metrics: dict[str, float], modules: list["RoutedBlock"]) -> str:
        path = modules[0].cfg.path if metrics["dre_routed"] else "warmup"
        return f"dre=[path={path},kept={metrics['dre_kept']:.1%}]"
