"""Where the raw corpus comes from: one DataFrame with a single "text" column, whatever the source.

Nothing is cleaned or dropped here (null texts stay None) so that validation sees the data exactly as it is.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pandas as pd

from ultrathink.config import DataConfig
from ultrathink.errors import StageError

TEXT = "text"
EMBEDDED = "embedded"
DATASET_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
SUPPORTED_SUFFIXES = (".txt", *DATASET_BUILDERS)
_STRING_TYPES = {"string", "large_string", "null"}  # "null": a column with no value at all, left to validation
_BLANK_LINE = re.compile(r"\n\s*\n")


class CorpusError(StageError, ValueError):
    """The corpus source cannot be read; the message names the file and, where relevant, the column."""


def load_corpus(cfg: DataConfig, root: Path = Path(".")) -> pd.DataFrame:
    """The corpus as a DataFrame with one object-dtype "text" column, first `cfg.max_samples` rows only."""
    if cfg.source == EMBEDDED:
        texts = embedded_paragraphs()
    else:
        texts = _read_file(Path(root) / cfg.source, cfg.text_column)
    if cfg.max_samples is not None:
        texts = texts[: cfg.max_samples]
    # Explicit object dtype: pandas' default string dtype would turn None into NaN.
    return pd.DataFrame({TEXT: pd.Series(texts, dtype=object)})


def split_paragraphs(text: str) -> list[str]:
    """Blank-line separated paragraphs, stripped, empty ones dropped: the unit of one document."""
    return [p for p in (part.strip() for part in _BLANK_LINE.split(text)) if p]


def embedded_paragraphs() -> list[str]:
    """The Python language reference shipped with CPython: a corpus that needs no download, in a fixed order."""
    from pydoc_data.topics import topics

    return [p for name in sorted(topics) for p in split_paragraphs(topics[name])]


def _read_file(path: Path, text_column: str) -> list[str | None]:
    """Dispatch on the file suffix; a missing file or an unknown format fails before any parsing."""
    if not path.is_file():
        raise CorpusError(f"corpus file not found: {path}")
    suffix = path.suffix.lower()
    if suffix == ".txt":
        return _read_txt(path)
    if suffix in DATASET_BUILDERS:
        return _read_dataset(path, DATASET_BUILDERS[suffix], text_column)
    raise CorpusError(f"{path}: unsupported corpus format {suffix!r}; supported: {', '.join(SUPPORTED_SUFFIXES)}")


def _read_txt(path: Path) -> list[str | None]:
    """A plain UTF-8 text file, split into paragraphs the same way as the embedded corpus."""
    try:
        return split_paragraphs(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise CorpusError(f"{path}: not valid UTF-8 at byte {exc.start}: {exc.reason}") from None


def _read_dataset(path: Path, builder: str, text_column: str) -> list[str | None]:
    """JSON, JSON Lines or Parquet through `datasets`, its Arrow cache in a temp dir so the project stays clean."""
    import datasets

    datasets.disable_progress_bars()
    with tempfile.TemporaryDirectory(prefix="ultrathink-datasets-") as cache_dir:
        try:
            ds = datasets.load_dataset(builder, data_files=str(path), split="train", cache_dir=cache_dir)
        except Exception as exc:  # the builders raise many types; all mean "this file cannot be parsed"
            raise CorpusError(f"{path}: cannot be read as {builder}: {exc}") from exc
        if text_column not in ds.column_names:
            raise CorpusError(
                f"{path}: no column {text_column!r} (data.text_column); columns: {', '.join(ds.column_names)}")
        feature = ds.features[text_column]
        if getattr(feature, "dtype", None) not in _STRING_TYPES:
            raise CorpusError(f"{path}: column {text_column!r} holds {feature}, expected strings")
        # Copy into Python objects (None for nulls) before the cache that backs the Arrow table is deleted.
        return list(ds[text_column])
