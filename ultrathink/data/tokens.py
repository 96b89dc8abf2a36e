"""Reading the prepare stage's packed token files: meta.json, and a split's shard files as one sequence of ids
(TokenShards). The writer (packing.py), its checks (token_checks.py), training and evaluation all read through here."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

SPLITS = ("train", "val")
META_FILE = "meta.json"


def read_meta(prepared_dir: Path) -> dict:
    """The meta.json written by `prepare_splits`."""
    path = Path(prepared_dir) / META_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {META_FILE} in {prepared_dir}: run the prepare stage first")
    return json.loads(path.read_text())


def load_split(prepared_dir: Path, split: str) -> TokenShards:
    """One split's token ids: its shard files, with the dtype recorded in meta.json, read as one sequence (a file's
    size must match its count in meta.json). A directory from before sharding has one `<split>.bin`; it reads the
    same way."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
    return open_split(prepared_dir, read_meta(prepared_dir), split)


def open_split(prepared_dir: Path, meta: dict, split: str) -> TokenShards:
    """`load_split` with the meta already read (prepare checks its files before it writes meta.json)."""
    shards = meta[split].get("shards") or [{"file": f"{split}.bin", "tokens": meta[split]["tokens"]}]
    dtype = np.dtype(meta["dtype"])
    paths = []
    for shard in shards:
        path = Path(prepared_dir) / shard["file"]
        if not path.is_file():
            raise FileNotFoundError(f"{path}: listed in meta.json but missing; re-run prepare")
        size = path.stat().st_size
        tokens = size // dtype.itemsize
        if tokens != shard["tokens"] or size % dtype.itemsize:
            raise ValueError(f"{path} holds {tokens} tokens, meta.json says {shard['tokens']}: the files do not "
                             "belong together; re-run prepare")
        paths.append(path)
    return TokenShards(paths, [s["tokens"] for s in shards], dtype)


class TokenShards:
    """A split's token files read as one sequence of ids: `len`, an id, or a slice (which may cross files). A slice
    is read from the files when asked (a copy, not a memory map), so a reader, each rank of a run, holds only the
    windows it reads, from whichever shards hold them, and a scan of the whole split (the token checks) stays at one
    chunk of memory. Every shard starts at a document's first token."""

    def __init__(self, paths: list[Path], lengths: list[int], dtype: np.dtype):
        self.paths, self.lengths, self.dtype = list(paths), list(lengths), np.dtype(dtype)
        self.ends = np.cumsum(self.lengths, dtype=np.int64)

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                raise ValueError("token shards are sliced contiguously (step 1)")
            pieces = []
            while start < stop:
                shard = int(np.searchsorted(self.ends, start, side="right"))
                base = int(self.ends[shard]) - self.lengths[shard]
                end = min(stop, int(self.ends[shard]))
                pieces.append(np.fromfile(self.paths[shard], dtype=self.dtype, count=end - start,
                                          offset=(start - base) * self.dtype.itemsize))
                start = end
            if len(pieces) == 1:
                return pieces[0]
            return np.concatenate(pieces) if pieces else np.empty(0, dtype=self.dtype)
        index = int(key) + (len(self) if int(key) < 0 else 0)
        if not 0 <= index < len(self):
            raise IndexError(f"token {key} of {len(self)}")
        return self[index : index + 1][0]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        whole = self[:]
        return whole if dtype is None else whole.astype(dtype)
