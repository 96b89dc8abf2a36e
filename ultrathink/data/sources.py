"""Where the raw corpus comes from: one DataFrame with a "text" column, whatever the source.

A source is one string (`data.source` or a `data.mixture` entry's `source`):
  embedded              the Python language reference (ultrathink.data.reference: a snapshot of CPython 3.11.7's, so
                        the same text on any interpreter; no download)
  hf:NAME               a Hugging Face dataset: `datasets.load_dataset(NAME, data.hf_config, split=data.split)`;
                        offline, it must already be in the local Hugging Face cache
  a directory           a dataset saved with `save_to_disk` (read with `load_from_disk`)
  a file or a glob      .txt (one document per paragraph, line or file: data.txt_unit), .json, .jsonl, .parquet or .csv; paths are relative
                        to the project root; a glob's files are read in sorted order and must share one format
`data.streaming` reads datasets-backed sources (hub, json/jsonl/parquet/csv, save_to_disk) as an IterableDataset:
rows are read lazily, no Arrow cache is written, and `max_samples` stops reading early.

Nothing is cleaned or dropped here (null texts stay None) so that validation sees the data exactly as it is.
"""

from __future__ import annotations

import glob
import re
import tempfile
from contextlib import ExitStack
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import numpy as np
import pandas as pd

from ultrathink.config import DataConfig
from ultrathink.data.reference import reference_topics
from ultrathink.errors import StageError

TEXT = "text"
SOURCE = "source"  # mixtures only: which component each document came from
EMBEDDED = "embedded"
HUB_PREFIX = "hf:"
DATASET_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
SUPPORTED_SUFFIXES = (".txt", *DATASET_BUILDERS)
SAVED_DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")  # written by save_to_disk
_STRING_TYPES = {"string", "large_string", "null"}  # "null": a column with no value at all, left to validation
_BLANK_LINE = re.compile(r"\n\s*\n")
_GLOB_CHARS = re.compile(r"[*?\[]")
_CHUNK_ROWS = 10_000


class CorpusError(StageError, ValueError):
    """The corpus source cannot be read; the message names the file and, where relevant, the column."""


@dataclass(frozen=True)
class SourceSpec:
    """One source to read: what `data.*` says for a single source, or one mixture entry with its defaults filled."""

    source: str
    text_column: str = TEXT
    hf_config: str | None = None
    split: str = "train"
    streaming: bool = False
    txt_unit: str = "paragraph"


def load_corpus(cfg: DataConfig, root: Path = Path(".")) -> pd.DataFrame:
    """The corpus as a DataFrame with one object-dtype "text" column (plus "source" for a mixture), at most
    `cfg.max_samples` rows: the first ones of a single source, a seeded weighted draw for a mixture."""
    if cfg.mixture:
        return _load_mixture(cfg, Path(root))
    spec = SourceSpec(cfg.source, cfg.text_column, cfg.hf_config, cfg.split, cfg.streaming, cfg.txt_unit)
    return _frame(read_source(spec, Path(root), cfg.max_samples))


def corpus_batches(cfg: DataConfig, root: Path, rows: int) -> Iterator[pd.DataFrame]:
    """The corpus of `load_corpus`, as DataFrames of at most `rows` rows, read lazily: a single source is never
    held whole (dataset files are streamed, .txt files read a line at a time, `max_samples` stops reading), nor is a
    mixture (its weighted draw reads each component twice: once to count, once to draw)."""
    if cfg.mixture:
        mixed = _mixture_rows(cfg, Path(root), streaming=True)
        while batch := list(islice(mixed, rows)):
            texts, sources = zip(*batch)
            yield _frame(list(texts), list(sources))
        return
    spec = SourceSpec(cfg.source, cfg.text_column, cfg.hf_config, cfg.split, True, cfg.txt_unit)
    texts = islice(iter_source(spec, Path(root)), cfg.max_samples)
    while batch := list(islice(texts, rows)):
        yield _frame(batch)


def corpus_parts(cfg: DataConfig, root: Path) -> list[DataConfig]:
    """The corpus as parts that can be read apart, in corpus order: one per file of a local file or glob source,
    else the whole corpus as one part (a hub dataset, a saved dataset, the embedded corpus, a mixture, or a
    `max_samples` limit, which counts from the corpus's start). Each part is a DataConfig for `corpus_batches`."""
    if cfg.mixture or cfg.max_samples is not None or cfg.source == EMBEDDED or cfg.source.startswith(HUB_PREFIX):
        return [cfg]
    path = Path(root) / cfg.source
    if not _GLOB_CHARS.search(cfg.source):
        return [cfg]
    files = sorted(f for f in glob.glob(str(path), recursive=True) if Path(f).is_file())
    if len(files) < 2 or len({Path(f).suffix.lower() for f in files}) > 1:
        return [cfg]  # the whole glob, so that reading it reports a missing file or mixed formats as before
    return [cfg.model_copy(update={"source": str(Path(f).resolve())}) for f in files]


def source_files(cfg: DataConfig, root: Path) -> list[Path]:
    """Every local file the corpus is read from (of each mixture component too): a file, a glob's files, or the
    files of a saved dataset's directory. The hub and the embedded corpus have none."""
    files = []
    for source in [m.source for m in cfg.mixture] if cfg.mixture else [cfg.source]:
        if source == EMBEDDED or source.startswith(HUB_PREFIX):
            continue
        path = Path(root) / source
        found = glob.glob(str(path), recursive=True) if _GLOB_CHARS.search(source) else [path]
        for hit in map(Path, sorted(found)):
            if hit.is_dir():  # a saved dataset
                files += sorted(f for f in hit.rglob("*") if f.is_file())
            elif hit.is_file():
                files.append(hit)
    return files


def read_source(spec: SourceSpec, root: Path, limit: int | None = None) -> list[str | None]:
    """The first `limit` texts (all when None) of one source, in the source's own order."""
    return list(islice(iter_source(spec, root), limit))


def iter_source(spec: SourceSpec, root: Path) -> Iterator[str | None]:
    """The texts of one source, in its own order, read as they are consumed."""
    if spec.source == EMBEDDED:
        return iter(embedded_paragraphs())
    if spec.source.startswith(HUB_PREFIX):
        return _read_hub(spec)
    return _read_local(spec, root)


def split_paragraphs(text: str) -> list[str]:
    """Blank-line separated paragraphs, stripped, empty ones dropped: the unit of one document."""
    return [p for p in (part.strip() for part in _BLANK_LINE.split(text)) if p]


def split_documents(text: str, unit: str) -> list[str]:
    """A .txt file's documents (data.txt_unit): paragraphs, non-blank lines or the whole file, each stripped of
    surrounding whitespace. The separators are not part of any document: no model is scored on them."""
    if unit == "paragraph":
        return split_paragraphs(text)
    if unit == "line":
        return [line for line in (raw.strip() for raw in text.splitlines()) if line]
    if unit == "file":
        return [text.strip()] if text.strip() else []
    raise ValueError(f"unknown txt unit {unit!r}; expected paragraph, line or file")


def embedded_paragraphs() -> list[str]:
    """The Python language reference (ultrathink.data.reference): a corpus that needs no download, in a fixed
    order."""
    topics = reference_topics()
    return [p for name in sorted(topics) for p in split_paragraphs(topics[name])]


def _frame(texts: list[str | None], sources: list[str] | None = None) -> pd.DataFrame:
    # Explicit object dtype: pandas' default string dtype would turn None into NaN.
    columns = {TEXT: pd.Series(texts, dtype=object)}
    if sources is not None:
        columns[SOURCE] = pd.Series(sources, dtype=object)
    return pd.DataFrame(columns)


# ---- mixtures ---------------------------------------------------------------------------------------------------

def _load_mixture(cfg: DataConfig, root: Path) -> pd.DataFrame:
    texts, sources = [], []
    for text, source in _mixture_rows(cfg, root, cfg.streaming):
        texts.append(text)
        sources.append(source)
    return _frame(texts, sources)


def _mixture_rows(cfg: DataConfig, root: Path, streaming: bool) -> Iterator[tuple[str | None, str]]:
    """Weighted mixture without repeats: each component gives its first n_i documents, n_i ∝ weight, and the
    documents are interleaved in an order drawn from `cfg.seed`. Yields (text, source), reading each component as
    it is consumed: a first pass counts (up to n_i) and a second draws, so no component is held in memory.

    With `max_samples` N, n_i = round(N·w_i/Σw) and a component with fewer documents is an error. Without it the
    mixture is as large as the scarcest component allows (relative to its weight), so no document repeats.
    """
    specs = [SourceSpec(m.source, m.text_column or cfg.text_column, m.hf_config, m.split or cfg.split,
                        streaming, cfg.txt_unit) for m in cfg.mixture]
    shares = np.array([m.weight for m in cfg.mixture], dtype=float)
    shares /= shares.sum()
    if cfg.max_samples is not None:
        counts = np.rint(shares * cfg.max_samples).astype(int)
        for spec, n in zip(specs, counts):
            got = sum(1 for _ in islice(iter_source(spec, root), int(n)))
            if got < n:
                raise CorpusError(f"data.mixture: source {spec.source!r} has {got} documents; its weight asks "
                                  f"for {n} of data.max_samples={cfg.max_samples}")
    else:
        sizes = [sum(1 for _ in iter_source(spec, root)) for spec in specs]
        total = min(size / share for size, share in zip(sizes, shares))
        counts = np.floor(shares * total + 1e-9).astype(int)
    labels = np.repeat(np.arange(len(specs)), counts)
    np.random.default_rng(cfg.seed).shuffle(labels)
    taken = [iter_source(spec, root) for spec in specs]
    for i in labels:
        yield next(taken[i]), specs[i].source


# ---- Hugging Face hub -------------------------------------------------------------------------------------------

def _read_hub(spec: SourceSpec) -> Iterator[str | None]:
    """A hub dataset by name through `datasets.load_dataset`, from the local Hugging Face cache when offline."""
    import datasets

    name = spec.source.removeprefix(HUB_PREFIX)
    datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset(name, spec.hf_config, split=spec.split, streaming=spec.streaming)
    except ConnectionError as exc:  # what `datasets` raises in offline mode for anything not cached
        raise CorpusError(
            f"{spec.source}: cannot be reached: this machine is offline and the dataset is not in the local Hugging "
            f"Face cache ({exc}). Where there is network, run `datasets.load_dataset({name!r}, "
            f"{spec.hf_config!r}, split={spec.split!r}).save_to_disk('data/raw/NAME')` and set data.source to "
            "that directory, or export it to .jsonl/.parquet files under data/raw/") from None
    except Exception as exc:  # unknown config or split, broken files: `datasets` raises many types
        raise CorpusError(f"{spec.source}: cannot be loaded (config {spec.hf_config!r}, split {spec.split!r}): "
                          f"{exc}") from exc
    yield from _column_texts(ds, spec.text_column, spec.source)


# ---- local files, globs and save_to_disk directories ------------------------------------------------------------

def _read_local(spec: SourceSpec, root: Path) -> Iterator[str | None]:
    path = root / spec.source
    if _GLOB_CHARS.search(spec.source):
        files = [Path(f) for f in sorted(glob.glob(str(path), recursive=True)) if Path(f).is_file()]
        if not files:
            raise CorpusError(f"no corpus files match {path}")
    elif path.is_dir():
        yield from _read_saved(spec, path)
        return
    elif path.is_file():
        files = [path]
    else:
        raise CorpusError(f"corpus file not found: {path}")
    suffixes = sorted({f.suffix.lower() for f in files})
    if len(suffixes) > 1:
        raise CorpusError(f"{path}: matches files of several formats ({', '.join(suffixes)}); use one glob per "
                          "format in data.mixture")
    suffix = suffixes[0]
    if suffix == ".txt":
        for f in files:
            yield from _read_txt(f, spec.txt_unit)
        return
    if suffix in DATASET_BUILDERS:
        yield from _read_files(files, DATASET_BUILDERS[suffix], spec)
        return
    raise CorpusError(f"{files[0]}: unsupported corpus format {suffix!r}; supported: {', '.join(SUPPORTED_SUFFIXES)}")


def _read_txt(path: Path, unit: str) -> Iterator[str]:
    """A plain UTF-8 text file, split into documents by `unit` (paragraphs: as the embedded corpus). Paragraphs and
    lines are read a line at a time, so a file larger than memory streams; they equal `split_documents` of the
    whole text (a paragraph ends at a line holding only whitespace)."""
    if unit == "file":
        yield from split_documents(_decode(path.read_bytes(), path, 0), unit)
        return
    if unit not in ("paragraph", "line"):
        raise ValueError(f"unknown txt unit {unit!r}; expected paragraph, line or file")
    paragraph: list[str] = []
    offset = 0
    with path.open("rb") as raw_lines:
        for raw in raw_lines:  # b"\n" never occurs inside a UTF-8 character
            text = _decode(raw, path, offset).replace("\r\n", "\n").replace("\r", "\n")  # as universal newlines
            offset += len(raw)
            lines = text.split("\n")
            for line in lines[:-1] if text.endswith("\n") else lines:
                if unit == "line":
                    yield from split_documents(line, "line")
                elif line.strip():
                    paragraph.append(line)
                elif paragraph:
                    yield "\n".join(paragraph).strip()
                    paragraph = []
    if paragraph:
        yield "\n".join(paragraph).strip()


def _decode(raw: bytes, path: Path, offset: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CorpusError(f"{path}: not valid UTF-8 at byte {offset + exc.start}: {exc.reason}") from None


def _read_files(files: list[Path], builder: str, spec: SourceSpec) -> Iterator[str | None]:
    """JSON, JSON Lines, Parquet or CSV through `datasets`, any Arrow cache in a temp dir so the project stays clean."""
    import datasets

    datasets.disable_progress_bars()
    where = str(files[0]) if len(files) == 1 else f"{files[0].parent}/{{{', '.join(f.name for f in files)}}}"
    with ExitStack() as stack:
        cache_dir = None if spec.streaming else stack.enter_context(
            tempfile.TemporaryDirectory(prefix="ultrathink-datasets-"))
        try:
            ds = datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train",
                                       cache_dir=cache_dir, streaming=spec.streaming)
            # Read while the cache that backs the Arrow table exists.
            yield from _column_texts(ds, spec.text_column, where)
        except CorpusError:
            raise
        except Exception as exc:  # the builders raise many types; all mean "this file cannot be parsed"
            raise CorpusError(f"{where}: cannot be read as {builder}: {exc}") from exc


def _read_saved(spec: SourceSpec, path: Path) -> Iterator[str | None]:
    """A Dataset or DatasetDict written by `save_to_disk`; `split` picks the DatasetDict's member."""
    import datasets

    if not any((path / marker).is_file() for marker in SAVED_DATASET_MARKERS):
        raise CorpusError(f"{path}: a directory, but not a dataset saved with save_to_disk (no "
                          f"{' or '.join(SAVED_DATASET_MARKERS)}); for files in it use a glob such as {path}/*.jsonl")
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as exc:
        raise CorpusError(f"{path}: cannot be read with load_from_disk: {exc}") from exc
    if isinstance(ds, datasets.DatasetDict):
        if spec.split not in ds:
            raise CorpusError(f"{path}: no split {spec.split!r} (data.split); splits: {', '.join(ds)}")
        ds = ds[spec.split]
    if spec.streaming:
        ds = ds.to_iterable_dataset()
    yield from _column_texts(ds, spec.text_column, str(path))


# ---- the text column --------------------------------------------------------------------------------------------

def _column_texts(ds, column: str, where: str) -> Iterator[str | None]:
    """The values of `column` of a Dataset or IterableDataset, checked to be strings or null, read as consumed."""
    columns = ds.column_names
    if columns is None:  # a streamed csv/json does not know its columns until its first row is read
        columns = list(next(iter(ds), {}))
    if column not in columns:
        raise CorpusError(f"{where}: no column {column!r} (data.text_column); columns: {', '.join(columns)}")
    feature = (ds.features or {}).get(column)
    if feature is not None and getattr(feature, "dtype", None) not in _STRING_TYPES:
        raise CorpusError(f"{where}: column {column!r} holds {feature}, expected strings")
    if hasattr(ds, "__len__"):  # an Arrow-backed Dataset: a column chunk at a time, at C speed
        values = (v for chunk in ds.select_columns([column]).iter(batch_size=_CHUNK_ROWS) for v in chunk[column])
    else:  # an IterableDataset
        values = (row[column] for row in ds.select_columns([column]))
    for number, value in enumerate(values):
        if value is not None and not isinstance(value, str):
            raise CorpusError(f"{where}: column {column!r} row {number} holds {type(value).__name__}, expected strings")
        yield value
