"""The validated corpus as shards: Parquet files (zstd-compressed, one "text" column) and an index.

A corpus larger than memory is written batch by batch (a row group per batch) into shards of about
`validate.shard_mb` megabytes of text each, and read back the same way, so no stage holds it whole. The index names
the shards in order with their documents and bytes; readers take the shards in that order, so the corpus has one
order everywhere. Parquet is read by pyarrow, datasets, datatrove, DuckDB and Spark alike.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

INDEX_FILE = "index.json"
SCHEMA = pa.schema([("text", pa.large_string())])
_READ_ROWS = 8192


class ShardWriter:
    """Appends batches of texts to numbered shards in `directory` (which must exist and be empty), starting a new
    shard once the current one holds `shard_bytes` of text; `close()` writes the index and returns it."""

    def __init__(self, directory: Path, shard_bytes: int):
        self.directory, self.shard_bytes = Path(directory), shard_bytes
        self.shards: list[dict] = []
        self._writer: pq.ParquetWriter | None = None

    def write(self, texts: list[str]) -> None:
        if not texts:
            return
        if self._writer is None or self.shards[-1]["bytes"] >= self.shard_bytes:
            self._start_shard()
        self._writer.write_table(pa.table({"text": pa.array(texts, type=pa.large_string())}, schema=SCHEMA))
        self.shards[-1]["documents"] += len(texts)
        self.shards[-1]["bytes"] += sum(len(t.encode("utf-8")) for t in texts)

    def _start_shard(self) -> None:
        if self._writer is not None:
            self._writer.close()
        name = f"part-{len(self.shards):05d}.parquet"
        self._writer = pq.ParquetWriter(self.directory / name, SCHEMA, compression="zstd")
        self.shards.append({"file": name, "documents": 0, "bytes": 0})

    def close(self) -> dict:
        if self._writer is not None:
            self._writer.close()
        index = {"format": "parquet", "column": "text", "shards": self.shards,
                 "documents": sum(s["documents"] for s in self.shards), "bytes": sum(s["bytes"] for s in self.shards)}
        (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return index


def is_sharded(path: Path) -> bool:
    return (Path(path) / INDEX_FILE).is_file()


def read_index(directory: Path) -> dict:
    path = Path(directory) / INDEX_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory}: no {INDEX_FILE}: not a sharded corpus (run the validate stage)")
    return json.loads(path.read_text())


def read_shards(directory: Path, progress=None) -> Iterator[str]:
    """Every text of the corpus, shard by shard in the index's order, a few thousand rows in memory at a time.
    `progress` (a tqdm bar), when given, advances by the UTF-8 bytes read."""
    directory = Path(directory)
    for shard in read_index(directory)["shards"]:
        for batch in pq.ParquetFile(directory / shard["file"]).iter_batches(batch_size=_READ_ROWS, columns=["text"]):
            texts = batch.column(0).to_pylist()
            if progress is not None:
                progress.update(sum(len(t.encode("utf-8")) for t in texts))
            yield from texts


def text_bytes(path: Path) -> int:
    """The corpus's UTF-8 bytes of text (a shard directory), or the file's size (a JSON-lines corpus)."""
    return read_index(path)["bytes"] if is_sharded(path) else Path(path).stat().st_size
