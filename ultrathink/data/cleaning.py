"""Cleaning after the validation gate: the gate judges the source as it is; cleaning makes the training corpus.

Each step takes the corpus (a DataFrame with a "text" column of str; other columns travel with their rows) and
returns the cleaned corpus and a count, so the validate report can say what every step did.
"""

from __future__ import annotations

import hashlib
import unicodedata

import numpy as np
import pandas as pd

from ultrathink.config import DataConfig
from ultrathink.data.constitution import Principle, apply_constitution

TEXT = "text"
_WHITESPACE_TO_SPACE = str.maketrans("\n\t\r", "   ")  # ordinary layout characters count as printable


def printable_ratio(text: str) -> float:
    """Share of characters that are printable or \\n, \\t, \\r; 1.0 for "" (it holds nothing unprintable)."""
    if not text:
        return 1.0
    if text.translate(_WHITESPACE_TO_SPACE).isprintable():  # the common case, at C speed
        return 1.0
    return sum(ch.isprintable() or ch in "\n\t\r" for ch in text) / len(text)


def clean_corpus(corpus: pd.DataFrame, cfg: DataConfig, principles: list[Principle],
                 seen: "SeenHashes | None" = None) -> tuple[pd.DataFrame, dict]:
    """Normalize, drop unprintable documents, apply the constitution, drop too short/long ones, de-duplicate.

    The order matters: normalization first so that later steps (and duplicates) see one spelling of each
    character; length after the constitution because redaction changes lengths; de-duplication last so that
    documents differing only in what was redacted count as copies. `seen`: the cleaned texts of earlier batches
    (a streamed corpus), for de-duplication across batches.
    """
    report: dict = {"documents_in": len(corpus)}
    corpus, report["normalized_documents"] = normalize_unicode(corpus, cfg.normalize)
    corpus, report["unprintable_removed"] = drop_unprintable(corpus, cfg.min_printable_ratio)
    corpus, report["constitution"] = apply_constitution(corpus, principles)
    corpus, report["too_short_removed"], report["too_long_removed"] = drop_by_length(
        corpus, cfg.min_chars, cfg.max_chars)
    report["duplicates_removed"] = 0
    if cfg.dedup:
        corpus, report["duplicates_removed"] = drop_exact_duplicates(corpus, seen)
    report["documents_kept"] = len(corpus)
    return corpus, report


def normalize_unicode(corpus: pd.DataFrame, form: str) -> tuple[pd.DataFrame, int]:
    """Apply Unicode normalization `form` (NFC, NFKC; "none" leaves the text alone); count changed documents.
    NFC merges decomposed accents (e + U+0301 → é) so one word has one spelling; NFKC also folds compatibility
    forms (ligatures, full-width letters, superscripts)."""
    if form == "none":
        return corpus, 0
    before = corpus[TEXT]
    after = before.map(lambda text: unicodedata.normalize(form, text))
    return corpus.assign(**{TEXT: after}), int((after != before).sum())


def drop_unprintable(corpus: pd.DataFrame, min_ratio: float) -> tuple[pd.DataFrame, int]:
    """Drop documents whose share of printable characters is below `min_ratio` (binary junk, mojibake)."""
    keep = corpus[TEXT].map(printable_ratio) >= min_ratio
    return corpus[keep].reset_index(drop=True), int((~keep).sum())


def drop_by_length(corpus: pd.DataFrame, min_chars: int, max_chars: int) -> tuple[pd.DataFrame, int, int]:
    """Drop documents shorter than `min_chars` or longer than `max_chars` characters; count each kind."""
    lengths = corpus[TEXT].str.len()
    short, long = lengths < min_chars, lengths > max_chars
    return corpus[~(short | long)].reset_index(drop=True), int(short.sum()), int(long.sum())


def drop_exact_duplicates(corpus: pd.DataFrame, seen: "SeenHashes | None" = None) -> tuple[pd.DataFrame, int]:
    """Keep the first occurrence of each text, compared by a 64-bit hash (8 bytes per distinct document, not a copy
    of every text). `seen` carries the texts of earlier batches, so a streamed corpus is de-duplicated as a whole.
    Repeated documents teach memorisation and inflate validation scores when a copy lands on each side of the split."""
    repeats = (seen if seen is not None else SeenHashes()).add(corpus[TEXT].tolist())
    return corpus[~repeats].reset_index(drop=True), int(repeats.sum())


def text_hashes(texts: list[str]) -> np.ndarray:
    """A 64-bit blake2b digest per text (a collision among 20 million distinct texts has a chance of about 1e-5)."""
    return np.fromiter((int.from_bytes(hashlib.blake2b(t.encode("utf-8"), digest_size=8).digest(), "little")
                        for t in texts), dtype=np.uint64, count=len(texts))


class SeenHashes:
    """Which texts were seen before, over batch after batch: the hashes of the distinct texts so far, kept as a few
    sorted runs (merged when one is no longer much smaller than the one before, so a lookup costs a few binary
    searches and the memory is 8 bytes per distinct text)."""

    def __init__(self):
        self.runs: list[np.ndarray] = []

    def __len__(self) -> int:
        return sum(len(run) for run in self.runs)

    def add(self, texts: list[str]) -> np.ndarray:
        """For each text, in order: whether it repeats an earlier one (of this batch or any before); all are added."""
        return self.add_hashes(text_hashes(texts))

    def add_hashes(self, hashes: np.ndarray) -> np.ndarray:
        """`add` for texts already hashed with `text_hashes`."""
        distinct, first, where = np.unique(hashes, return_index=True, return_inverse=True)
        repeats = np.ones(len(hashes), dtype=bool)
        repeats[first] = False
        known = np.zeros(len(distinct), dtype=bool)
        for run in self.runs:
            at = np.minimum(np.searchsorted(run, distinct), len(run) - 1)
            known |= run[at] == distinct
        repeats |= known[where.reshape(-1)]
        if not known.all():
            self.runs.append(distinct[~known])
        while len(self.runs) > 1 and len(self.runs[-2]) <= 2 * len(self.runs[-1]):
            newest = self.runs.pop()
            self.runs[-1] = np.union1d(self.runs[-1], newest)
        return repeats
