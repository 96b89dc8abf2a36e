"""Batches of next-token windows from a packed token file, in a seeded order that can be saved and resumed.

The token stream is cut into non-overlapping windows of seq_len+1 tokens; each epoch visits every window once in a
permutation drawn from (seed, epoch). The loader's position is two integers, so a resumed run reads exactly the
batches the uninterrupted run would have read.
"""

from __future__ import annotations

import numpy as np
import torch


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
    """A loader whose position is an EpochOrder (`self.order`): checkpointed and resumed with it."""

    order: EpochOrder

    def state_dict(self) -> dict[str, int]:
        return self.order.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.order.load_state_dict(state)

    def __iter__(self):
        return self


class TokenWindows(OrderedBatches):
    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int, shuffle: bool = True,
                 rank: int = 0, world_size: int = 1):
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.rank, self.world_size = rank, world_size
        self.n_windows = (len(tokens) - 1) // seq_len
        if self.n_windows < batch_size * world_size:
            raise ValueError(
                f"{len(tokens)} tokens make {self.n_windows} windows of {seq_len + 1}, fewer than one batch "
                f"({batch_size} × {world_size} ranks): use a larger corpus or a smaller seq_len / batch_size")
        self.order = EpochOrder(self.n_windows, seed, shuffle)

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        # Each rank takes its own contiguous slice of the global batch: disjoint data across ranks.
        step = self.order.take(self.batch_size * self.world_size)
        windows = step[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]
        batch = np.stack([self.tokens[w * self.seq_len : w * self.seq_len + self.seq_len + 1] for w in windows])
        batch = torch.from_numpy(batch.astype(np.int64))
        return batch[:, :-1], batch[:, 1:]


def eval_batches(tokens: np.ndarray, seq_len: int, batch_size: int, max_batches: int | None = None):
    """The validation split in order, as (x, y) batches; the same batches on every call."""
    loader = TokenWindows(tokens, seq_len, min(batch_size, max(1, (len(tokens) - 1) // seq_len)), seed=0,
                          shuffle=False)
    n = loader.n_windows // loader.batch_size
    for _ in range(n if max_batches is None else min(n, max_batches)):
        yield next(loader)


class TokenStreamEval:
    """Validation data as a packed token stream (the val split): its windows of seq_len in order. Other validation
    data (held-out chats, ultrathink.finetune.pairs.ChatEval) offers the same `eval_batches`."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len

    def eval_batches(self, batch_size: int, max_batches: int | None = None):
        return eval_batches(self.tokens, self.seq_len, batch_size, max_batches)
