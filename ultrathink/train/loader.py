"""Batches of next-token windows from a packed token file, in a seeded order that can be saved and resumed.

The token stream is cut into non-overlapping windows of seq_len+1 tokens; each epoch visits every window once in a
permutation drawn from (seed, epoch). The loader's position is two integers, so a resumed run reads exactly the
batches the uninterrupted run would have read.
"""

from __future__ import annotations

import numpy as np
import torch


class TokenWindows:
    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int, shuffle: bool = True,
                 rank: int = 0, world_size: int = 1):
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.seed, self.shuffle, self.rank, self.world_size = seed, shuffle, rank, world_size
        self.n_windows = (len(tokens) - 1) // seq_len
        if self.n_windows < batch_size * world_size:
            raise ValueError(
                f"{len(tokens)} tokens make {self.n_windows} windows of {seq_len + 1}, fewer than one batch "
                f"({batch_size} × {world_size} ranks): use a larger corpus or a smaller seq_len / batch_size")
        self.epoch, self.position = 0, 0
        self._order = self._epoch_order()

    def _epoch_order(self) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.n_windows)
        return np.random.default_rng([self.seed, self.epoch]).permutation(self.n_windows)

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seed, self.epoch, self.position = int(state["seed"]), int(state["epoch"]), int(state["position"])
        self._order = self._epoch_order()

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        step = self.batch_size * self.world_size
        if self.position + step > self.n_windows:  # drop the ragged end; the next epoch reshuffles
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._epoch_order()
        # Each rank takes its own contiguous slice of the global batch: disjoint data across ranks.
        start = self.position + self.rank * self.batch_size
        windows = self._order[start : start + self.batch_size]
        self.position += step
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
