"""Batches of next-token windows from a packed token file, in a seeded order that can be saved and resumed.

The token stream is cut into non-overlapping windows of seq_len+1 tokens; each epoch visits every window once in a
permutation drawn from (seed, epoch). The first epoch cuts the windows from token 0; each later one from an offset
drawn from (seed, epoch), so a corpus read several times is not cut at the same places each time (0.007-0.021
bits/byte better at equal steps on three corpora read 4-7 times, at every seed: benchmarks/README.md). The loader's
position is two integers, so a resumed run reads exactly the batches the uninterrupted run would have read.

An optimizer step reads one global batch, train.batch_size × train.grad_accum sequences, whatever the number of
ranks: with N ranks each takes its own contiguous 1/N of it (BatchLayout). The position therefore does not depend on
the number of ranks, and a run checkpointed on 2 ranks resumes on 1 or 4 at the same place in the data.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ultrathink.errors import StageError


class BatchSplitError(StageError):
    """The global batch cannot be split evenly over the ranks."""


@dataclass(frozen=True)
class BatchLayout:
    """One optimizer step's global batch of `sequences` split over `world_size` ranks: each takes `accum`
    micro-batches of `micro` sequences (never more than train.batch_size, so memory per rank does not grow)."""

    sequences: int
    world_size: int
    micro: int
    accum: int

    @classmethod
    def split(cls, batch_size: int, grad_accum: int, world_size: int = 1, knobs: str | None = None) -> BatchLayout:
        """`knobs`: the settings that made the global batch, for the error (default train.batch_size × grad_accum)."""
        sequences = batch_size * grad_accum
        if sequences % world_size:
            knobs = knobs or f"train.batch_size {batch_size} × train.grad_accum {grad_accum}"
            raise BatchSplitError(f"the global batch of {sequences} sequences ({knobs}) cannot be split evenly over "
                                  f"{world_size} ranks: make it a multiple of {world_size}")
        per_rank = sequences // world_size
        accum = -(-per_rank // batch_size)  # the fewest micro-batches of at most batch_size
        while per_rank % accum:
            accum += 1
        return cls(sequences, world_size, per_rank // accum, accum)

    @property
    def per_rank(self) -> int:
        return self.micro * self.accum


class EpochOrder:
    """Indices 0..n-1 in a permutation drawn from (seed, epoch), taken a step at a time; a step that would run past
    the end starts the next epoch (the ragged end is dropped). Its state is (seed, epoch, position)."""

    def __init__(self, n: int, seed: int, shuffle: bool = True):
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._epoch_order()

    def _epoch_order(self) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.n)
        return np.random.default_rng([self.seed, self.epoch]).permutation(self.n)

    def take(self, count: int) -> np.ndarray:
        if self.position + count > self.n:
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._epoch_order()
        taken = self._order[self.position : self.position + count]
        self.position += count
        return taken

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seed, self.epoch, self.position = int(state["seed"]), int(state["epoch"]), int(state["position"])
        self._order = self._epoch_order()


class OrderedBatches:
    """A loader whose position is an EpochOrder: checkpointed and resumed with it. Each optimizer step takes the
    layout's global batch from the order; this rank reads its own slice of it, a micro-batch per call."""

    def _start_order(self, n: int, seed: int, shuffle: bool, layout: BatchLayout, rank: int) -> None:
        self.order, self.layout, self.rank = EpochOrder(n, seed, shuffle), layout, rank
        self._micro_batches: list[np.ndarray] = []  # what is left of this rank's share of the current step

    def next_rows(self) -> np.ndarray:
        """The indices of this rank's next micro-batch."""
        if not self._micro_batches:
            step, size = self.order.take(self.layout.sequences), self.layout.per_rank
            mine = step[self.rank * size : (self.rank + 1) * size]
            self._micro_batches = list(mine.reshape(self.layout.accum, self.layout.micro))
        return self._micro_batches.pop(0)

    def state_dict(self) -> dict[str, int]:
        if self._micro_batches:  # checkpoints are taken between optimizer steps
            raise RuntimeError("the loader is in the middle of an optimizer step's batch")
        return self.order.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.order.load_state_dict(state)
        self._micro_batches = []

    def __iter__(self):
        return self


OFFSET_STREAM = 7  # keeps the draw of an epoch's offset apart from its permutation's, both from (seed, epoch)


class TokenWindows(OrderedBatches):
    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int, shuffle: bool = True,
                 rank: int = 0, world_size: int = 1, grad_accum: int = 1):
        self.tokens, self.seq_len = tokens, seq_len
        layout = BatchLayout.split(batch_size, grad_accum, world_size)
        self.n_windows = (len(tokens) - 1) // seq_len
        if self.n_windows < layout.sequences:
            raise ValueError(
                f"{len(tokens)} tokens make {self.n_windows} windows of {seq_len + 1}, fewer than one batch "
                f"({layout.sequences} sequences): use a larger corpus or a smaller seq_len / batch_size")
        self._start_order(self.n_windows, seed, shuffle, layout, rank)

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        windows = self.next_rows()
        # A window shifted past the stream's end wraps to its start: still seq_len + 1 tokens of the corpus.
        starts = (windows * self.seq_len + self.offset(self.order.epoch)) % (len(self.tokens) - self.seq_len)
        batch = np.stack([self.tokens[s : s + self.seq_len + 1] for s in starts])
        batch = torch.from_numpy(batch.astype(np.int64))
        return batch[:, :-1], batch[:, 1:]

    def offset(self, epoch: int) -> int:
        """Where this epoch's windows start, in tokens: 0 in the first epoch and whenever the order is fixed
        (validation reads the same windows every time), else drawn from (seed, epoch)."""
        if epoch == 0 or not self.order.shuffle:
            return 0
        return int(np.random.default_rng([self.order.seed, epoch, OFFSET_STREAM]).integers(self.seq_len))


@dataclass(frozen=True)
class ContextWarmup:
    """Short contexts first (train.seq_len_warmup): for the first `steps` optimizer steps each window of seq_len
    tokens is read as 4 windows of seq_len / 4 (the first half of those steps), then 2 of seq_len / 2; from then on
    whole. A step reads the same tokens and predicts the same targets, only with less of the text before each:
    cheaper steps (attention shrinks with the context; 1.14-1.24× faster at a quarter or half of 128 tokens on a
    CPU) that measured better even at equal steps where a corpus is read many times, and worse where it is read a
    few times (sizing.seq_len_warmup_for). A fraction of seq_len that is not a whole number of tokens is skipped
    (an odd seq_len is never cut)."""

    steps: int
    seq_len: int

    def parts(self, step: int) -> int:
        """Into how many windows each row of optimizer step `step` (0-based) is cut."""
        for parts, until in ((4, self.steps / 2), (2, self.steps)):
            if step < until and self.seq_len % parts == 0:
                return parts
        return 1

    def cut(self, batch: tuple[torch.Tensor, torch.Tensor], step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) of (rows, seq_len) as (rows × parts, seq_len / parts): consecutive pieces of each row, whose
        targets are still each input's next token."""
        parts = self.parts(step)
        return batch if parts == 1 else tuple(t.reshape(t.shape[0] * parts, -1) for t in batch)


def eval_batches(tokens: np.ndarray, seq_len: int, batch_size: int, max_batches: int | None = None):
    """The validation split in order, as (x, y) batches; the same batches on every call."""
    loader = TokenWindows(tokens, seq_len, min(batch_size, max(1, (len(tokens) - 1) // seq_len)), seed=0,
                          shuffle=False)
    n = loader.n_windows // loader.layout.sequences
    for _ in range(n if max_batches is None else min(n, max_batches)):
        yield next(loader)


class TokenStreamEval:
    """Validation data as a packed token stream (the val split): its windows of seq_len in order. Other validation
    data (held-out chats, ultrathink.finetune.pairs.ChatEval) offers the same `eval_batches`."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len

    def eval_batches(self, batch_size: int, max_batches: int | None = None):
        return eval_batches(self.tokens, self.seq_len, batch_size, max_batches)
