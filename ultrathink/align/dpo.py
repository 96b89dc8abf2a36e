"""Direct Preference Optimization's objective (Rafailov et al. 2023) and the sums it is built from.

A pair is a prompt with a chosen and a rejected answer. A model's log-probability of an answer is the sum of its
answer tokens' log-probabilities given the prompt (the same answer-only targets fine-tuning trains on). The implicit
reward of an answer is β · (log π(answer) − log π_ref(answer)): how much more likely the policy makes it than the
frozen reference it started from. With h = (log π(c) − log π(r)) − (log π_ref(c) − log π_ref(r)), the losses are
TRL's of the same names:

    sigmoid  −log σ(β h)            (DPO; Bradley–Terry on the implicit rewards)
    hinge    max(0, 1 − β h)        (SLiC)
    ipo      (h − 1/(2β))²          (IPO, Azar et al. 2023: a bounded margin instead of one pushed without end)

The reference's log-probabilities are computed once, before training (the reference stays frozen by construction:
no reference model is kept, nothing of it can be trained).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from ultrathink.scoring import answer_logprobs, chat_rows, pair_chats
from ultrathink.train.engine import autocast
from ultrathink.train.loader import BatchLayout, OrderedBatches


LossKind = Literal["sigmoid", "hinge", "ipo"]


@dataclass(frozen=True)
class PreferenceTerms:
    """Per-pair results: the loss and both implicit rewards, shape (pairs,)."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor

    @property
    def margins(self) -> torch.Tensor:
        return self.chosen_rewards - self.rejected_rewards


def preference_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
                    ref_rejected: torch.Tensor, beta: float, kind: LossKind = "sigmoid") -> PreferenceTerms:
    """The `kind` loss of each pair from the answers' summed log-probabilities under the policy and the reference.
    Rewards are detached: they are reported, not trained."""
    chosen_ratio, rejected_ratio = policy_chosen - ref_chosen, policy_rejected - ref_rejected
    h = chosen_ratio - rejected_ratio
    if kind == "sigmoid":
        losses = -F.logsigmoid(beta * h)
    elif kind == "hinge":
        losses = torch.relu(1 - beta * h)
    elif kind == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown preference loss {kind!r} (sigmoid, hinge or ipo)")
    return PreferenceTerms(losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach())



@dataclass(frozen=True)
class PairRows:
    """Preference pairs as padded rows (scoring.chat_rows of each answer's chat), with the reference's summed
    log-probabilities of both answers: what a batch of the objective holds. Row i of every tensor is pair i."""

    chosen_x: torch.Tensor
    chosen_y: torch.Tensor
    rejected_x: torch.Tensor
    rejected_y: torch.Tensor
    ref_chosen: torch.Tensor
    ref_rejected: torch.Tensor

    @classmethod
    def of(cls, tokenizer, pairs: list[dict], seq_len: int, reference: tuple[torch.Tensor, torch.Tensor]) -> "PairRows":
        chosen, rejected = pair_chats(pairs)
        cx, cy, _ = chat_rows(tokenizer, chosen, seq_len + 1)
        rx, ry, _ = chat_rows(tokenizer, rejected, seq_len + 1)
        return cls(cx, cy, rx, ry, *reference)

    def __len__(self) -> int:
        return len(self.chosen_x)

    def take(self, rows) -> "PairRows":
        return PairRows(*(t[rows] for t in (self.chosen_x, self.chosen_y, self.rejected_x, self.rejected_y,
                                             self.ref_chosen, self.ref_rejected)))


class PairBatches(OrderedBatches):
    """Preference pairs in a seeded order per epoch, for the Trainer: next() gives a PairRows of this rank's
    micro-batch; the position is (seed, epoch, position), so a resumed run reads the same batches."""

    def __init__(self, rows: PairRows, seq_len: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1):
        self.rows = rows
        self.seq_len = 2 * seq_len  # a pair is two rows: tokens per step count both
        size = min(batch_size, len(rows))
        knobs = (f"align.batch_size {batch_size}" if size == batch_size
                 else f"{len(rows)} training pairs, fewer than align.batch_size {batch_size}")
        self._start_order(len(rows), seed, True, BatchLayout.split(size, 1, world_size, knobs), rank)

    def __next__(self) -> PairRows:
        return self.rows.take(torch.from_numpy(self.next_rows()))


class PairEval:
    """Held-out pairs for the Trainer's validation: every pair, in order."""

    def __init__(self, rows: PairRows):
        self.rows = rows

    def eval_batches(self, batch_size: int, max_batches: int | None = None):
        for n, i in enumerate(range(0, len(self.rows), batch_size)):
            if max_batches is not None and n >= max_batches:
                return
            yield self.rows.take(slice(i, i + batch_size))


class Preference:
    """The Trainer's objective for alignment: the mean `kind` loss over a micro-batch's pairs. Both answers go
    through one forward (chosen rows, then rejected rows), as TRL's concatenated forward does; the routing
    variants' aux losses are added as in pretraining."""

    def __init__(self, beta: float, kind: LossKind):
        self.beta, self.kind = beta, kind

    def weight(self, batch: PairRows) -> int:
        return len(batch)

    def terms(self, module, batch: PairRows, device) -> tuple[PreferenceTerms, torch.Tensor | None, dict]:
        x = torch.cat([batch.chosen_x, batch.rejected_x]).to(device, non_blocking=True)
        y = torch.cat([batch.chosen_y, batch.rejected_y]).to(device, non_blocking=True)
        out = module(x, y)
        chosen, rejected = answer_logprobs(out.logits, y).split(len(batch))
        terms = preference_loss(chosen, rejected, batch.ref_chosen.to(device), batch.ref_rejected.to(device),
                                self.beta, self.kind)
        return terms, out.aux_loss, out.routing

    def loss(self, module, batch: PairRows, device) -> tuple[torch.Tensor, dict]:
        terms, aux, routed = self.terms(module, batch, device)
        loss = terms.losses.mean()
        return (loss if aux is None else loss + aux), routed

    @torch.no_grad()
    def validate(self, model, val_data: PairEval, cfg) -> float:
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        total, count = 0.0, 0
        for batch in val_data.eval_batches(cfg.batch_size, cfg.eval_batches):
            with autocast(cfg.precision, str(device)):
                terms = self.terms(model, batch, device)[0]
            total += float(terms.losses.sum())
            count += len(batch)
        model.train(was_training)
        return total / max(count, 1)
