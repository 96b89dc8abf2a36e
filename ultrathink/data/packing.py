"""Tokenized train/val splits as flat token files that the trainer memory-maps.

Every document is encoded without special tokens and followed by one EOS id; documents are concatenated. A document's
split follows from a hash of its text alone, so it does not depend on order, seed or machine, and copies of one text
always land in the same split (no train/val leakage through duplicates).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import ExitStack
from itertools import chain
from pathlib import Path

import numpy as np

from ultrathink.config import PrepareConfig
from ultrathink.io import atomic_dir
from ultrathink.tokenizer import load_tokenizer

SPLITS = ("train", "val")
META_FILE = "meta.json"


def prepare_splits(corpus_jsonl: Path, tokenizer_dir: Path, cfg: PrepareConfig, out_dir: Path) -> dict:
    """Write train.bin, val.bin and meta.json into `out_dir` (replaced as a whole at the end); return the meta.

    meta.json: dtype, vocab_size, eos_id, val_fraction, moved_last_document_to (the split that received the last
    document because hashing left it empty, else None), and per split: tokens, bytes (UTF-8 bytes of the documents'
    text, the bits-per-byte denominator) and documents.
    """
    corpus_jsonl, out_dir = Path(corpus_jsonl), Path(out_dir)
    tokenizer = load_tokenizer(tokenizer_dir)
    dtype = np.dtype(np.uint16 if len(tokenizer) <= 65535 else np.uint32)
    in_val, moved = _assign_splits(corpus_jsonl, cfg.val_fraction)
    stats = {split: {"tokens": 0, "bytes": 0, "documents": 0} for split in SPLITS}
    with atomic_dir(out_dir) as tmp, ExitStack() as files:
        outputs = {split: files.enter_context(open(tmp / f"{split}.bin", "wb")) for split in SPLITS}
        start = 0
        for texts in _batches(_read_texts(corpus_jsonl), cfg.batch_size):
            ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
            flags = in_val[start : start + len(texts)]
            for split in SPLITS:
                chosen = [(t, i) for t, i, v in zip(texts, ids, flags) if v == (split == "val")]
                _append(outputs[split], stats[split], chosen, tokenizer.eos_token_id, dtype)
            start += len(texts)
        files.close()  # flush before meta.json marks the output complete
        meta = {
            "dtype": dtype.name, "vocab_size": len(tokenizer), "eos_id": tokenizer.eos_token_id,
            "val_fraction": cfg.val_fraction, "moved_last_document_to": moved, **stats,
        }
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def read_meta(prepared_dir: Path) -> dict:
    """The meta.json written by `prepare_splits`."""
    path = Path(prepared_dir) / META_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {META_FILE} in {prepared_dir}: run the prepare stage first")
    return json.loads(path.read_text())


def load_split(prepared_dir: Path, split: str) -> np.memmap:
    """One split's token ids, memory-mapped read-only with the dtype recorded in meta.json."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
    meta = read_meta(prepared_dir)
    tokens = np.memmap(Path(prepared_dir) / f"{split}.bin", dtype=meta["dtype"], mode="r")
    if len(tokens) != meta[split]["tokens"]:
        raise ValueError(f"{prepared_dir}/{split}.bin holds {len(tokens)} tokens, meta.json says "
                         f"{meta[split]['tokens']}: the files do not belong together; re-run prepare")
    return tokens


def split_fraction(text: str) -> float:
    """A stable pseudo-random number in [0, 1) from the text alone: the same on every machine and run."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def _assign_splits(corpus_jsonl: Path, val_fraction: float) -> tuple[np.ndarray, str | None]:
    """One flag per document (True: val), and which split got the last document if hashing left one empty."""
    in_val = np.fromiter((split_fraction(t) < val_fraction for t in _read_texts(corpus_jsonl)), dtype=bool)
    if len(in_val) < 2:
        raise ValueError(f"{corpus_jsonl}: {len(in_val)} document(s); train and val need at least one each")
    if in_val.all() or not in_val.any():
        moved = "train" if in_val[-1] else "val"
        in_val[-1] = not in_val[-1]
        return in_val, moved
    return in_val, None


def _read_texts(corpus_jsonl: Path) -> Iterator[str]:
    """The "text" of each JSON line, streamed; blank lines are skipped, anything else malformed is an error."""
    with open(corpus_jsonl, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                text = json.loads(line).get("text")
            except (json.JSONDecodeError, AttributeError) as exc:
                raise ValueError(f"{corpus_jsonl}:{number}: not a JSON object: {exc}") from None
            if not isinstance(text, str):
                got = "null or no 'text' key" if text is None else type(text).__name__
                raise ValueError(f"{corpus_jsonl}:{number}: 'text' must be a string, got {got}")
            yield text


def _batches(texts: Iterator[str], size: int) -> Iterator[list[str]]:
    """Consecutive lists of up to `size` texts, so only one batch of tokens is ever held in memory."""
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _append(out, stats: dict, docs: list[tuple[str, list[int]]], eos_id: int, dtype: np.dtype) -> None:
    """Write the documents' ids, each followed by EOS, to `out`, and count tokens, bytes and documents."""
    tokens = np.fromiter(chain.from_iterable(ids + [eos_id] for _, ids in docs), dtype=dtype)
    out.write(tokens.tobytes())
    stats["tokens"] += len(tokens)
    stats["bytes"] += sum(len(text.encode("utf-8")) for text, _ in docs)
    stats["documents"] += len(docs)
