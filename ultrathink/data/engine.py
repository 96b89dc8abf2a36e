"""The validate stage's work on a datatrove executor: the corpus's parts gated and cleaned in parallel tasks, then
put together in corpus order.

    parts (ultrathink.data.sources.corpus_parts: one per file of a glob)
      │  CleanParts, a datatrove PipelineStep, in `validate.workers` processes (LocalPipelineExecutor) or on a Ray
      │  cluster (RayPipelineExecutor), `validate.executor`: per part, batch by batch, the source suite without
      │  "duplicates", then cleaning without de-duplication; it writes the cleaned rows (text, hash, the
      │  constitution's flags), the source rows' hashes and previews, and its counts into the work directory
      ▼
    assemble (this process, in part order): the source's repeats and the cleaned corpus's duplicates found by hash
      across the whole corpus (SeenHashes, 8 bytes per distinct text), the "duplicates" expectation and the cleaned
      suite run on those, the kept rows written as the validated shards

The expensive work (Unicode normalization, the constitution's regexes, GX on the texts) runs in the tasks; what needs
the corpus order runs once on hashes and flags. The result equals the one-process pass row for row: the same
report (counts, examples numbered by their row in the corpus) and the same shards, whatever the number of tasks or
workers (tested).

Why our own reading step, not datatrove's JsonlReader/ParquetReader: they skip a row whose text is missing or
empty and a line that is not JSON with a warning (datatrove/pipeline/readers/base.py, jsonl.py), where the gate
must count the first and the stage must stop, naming file and line, at the second. Why not its exact dedup: its
three stages re-read the corpus, and which copy it keeps among several files is not the first in corpus order;
SeenHashes keeps the first and needs one pass over 8-byte hashes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from datatrove.pipeline.base import PipelineStep

from ultrathink.config import DataConfig, Params
from ultrathink.errors import StageError
from ultrathink.io import atomic_write_json
from ultrathink.data.cleaning import SeenHashes, clean_corpus, text_hashes
from ultrathink.data.constitution import Principle, load_constitution, violation_column
from ultrathink.data.shards import ShardWriter
from ultrathink.data.sources import SOURCE, TEXT, corpus_batches, corpus_parts, source_files
from ultrathink.data.validation import (REPEATS, CleanedGate, SourceGate, ValidationReport, clip_example,
                                        source_check_names)

HASH = "hash"
PREVIEW = "preview"
_DUPLICATES = "duplicates"


def add_counts(total: dict, counts: dict) -> dict:
    """Sum nested count dicts (the cleaning report of each batch); labels (a principle's action) are kept."""
    for key, value in counts.items():
        if isinstance(value, dict):
            total[key] = add_counts(total.get(key, {}), value)
        else:
            total[key] = value if isinstance(value, str) else total.get(key, 0) + value
    return total


class CleanParts(PipelineStep):
    """datatrove step: gate and clean the parts `rank, rank + world_size, ...` of the corpus, each into its own
    files in `work` (the input documents of the pipeline are not used: the step reads its parts itself)."""

    name = "gate and clean"
    type = "ultrathink"

    def __init__(self, params: Params, parts: list[DataConfig], work: str, root: str):
        super().__init__()
        self.params, self.parts, self.work, self.root = params, parts, work, root

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        cfg = self.params.validate_cfg
        principles = _principles(self.params, Path(self.root))
        gate = SourceGate(cfg, checks=_part_checks(cfg))  # one GX context per task, reset per part
        for index in range(rank, len(self.parts), world_size):
            if not Path(_part_files(Path(self.work), index)["counts"]).exists():  # else done by a run that was cut
                gate.reset()
                self._clean_part(index, gate, principles)
        yield from ()

    def _clean_part(self, index: int, gate: SourceGate, principles: list[Principle]) -> None:
        cfg, data = self.params.validate_cfg, self.params.data
        without_dedup = data.model_copy(update={"dedup": False})  # de-duplication needs the corpus order: assemble
        files = _part_files(Path(self.work), index)
        raw_out = clean_out = None
        cleaning: dict = {}
        for batch in corpus_batches(self.parts[index], Path(self.root), cfg.batch_rows):
            gate.add(batch)
            raw = _raw_rows(batch)
            raw_out = raw_out or pq.ParquetWriter(files["raw.tmp"], raw.schema, compression="zstd")
            raw_out.write_table(raw)
            cleaned, counts = clean_corpus(batch.dropna(subset=[TEXT]), without_dedup, principles)
            cleaning = add_counts(cleaning, {**counts, "documents_in": len(batch)})
            table = _cleaned_rows(cleaned, principles)
            clean_out = clean_out or pq.ParquetWriter(files["clean.tmp"], table.schema, compression="zstd")
            clean_out.write_table(table)
        for writer in (raw_out, clean_out):
            if writer is not None:
                writer.close()
        for name in ("raw", "clean"):
            if Path(files[f"{name}.tmp"]).exists():
                os.replace(files[f"{name}.tmp"], files[name])
        # last: marks the part complete
        atomic_write_json(files["counts"], {"gate": gate.state(), "cleaning": cleaning})


def validate_in_parts(params: Params, out: Path) -> tuple[ValidationReport, ValidationReport, dict]:
    """Gate, clean and write the corpus of `params.data` as shards into `out` (an empty directory), in parts on the
    executor `params.validate_cfg.executor`; paths are relative to the working directory (the project root).
    Returns (the source report, the cleaned report, the rest of the stage report: cleaning counts, shards, bytes,
    and documents per source for a mixture). The work directory goes once the parts are put together (whether the
    gates pass or not). When a task fails (a file that cannot be read) or the run is killed, it stays, so that the
    next run of the same inputs redoes only the parts not finished; a run of other inputs removes it."""
    cfg, root = params.validate_cfg, Path.cwd()
    parts = corpus_parts(params.data, root)
    work = _work_dir(params, root, Path(params.paths.validated_corpus).resolve())
    for stale in work.parent.glob("*") if work.parent.is_dir() else []:
        if stale != work:  # left by a failed run of other inputs: it can never be reused
            shutil.rmtree(stale, ignore_errors=True)
    # Each task builds its GX suite once; four per worker balance the load without one suite per file of a huge glob.
    tasks = min(len(parts), cfg.tasks or 4 * (cfg.workers or os.cpu_count() or 1))
    executor = data_executor(cfg, [CleanParts(params, parts, str(work), str(root))], tasks=tasks,
                             logging_dir=work / "logs")
    executor.run()  # a local task's error (a file that cannot be read) comes out here, naming the file
    unfinished = [part.source for index, part in enumerate(parts)
                  if not Path(_part_files(work, index)["counts"]).exists()]
    if unfinished:  # Ray retries a failed task and logs why; it does not raise
        named = ", ".join(unfinished[:3]) + (" …" if len(unfinished) > 3 else "")
        raise StageError(f"validate: {len(unfinished)} of {len(parts)} parts did not finish on the {cfg.executor} "
                         f"executor ({named}); the task logs are in {work / 'logs'}; run again to redo only those")
    try:
        return _assemble(params, len(parts), work, out)
    finally:
        shutil.rmtree(work.parent, ignore_errors=True)


def data_executor(cfg, pipeline: list, tasks: int, logging_dir: Path):
    """A datatrove executor for `pipeline`: local processes (at most `cfg.workers` at once; default all cores) or
    a Ray cluster (`ray.init()` joins the one RAY_ADDRESS names, or starts a local one). Finished tasks leave a
    completion mark in `logging_dir`, so a run that was killed redoes only the unfinished ones."""
    if cfg.executor == "ray":
        try:
            import ray
        except ImportError:
            raise StageError("validate.executor: ray needs the ray package: pip install ray") from None
        from datatrove.executor import RayPipelineExecutor

        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS") or None, include_dashboard=False, log_to_driver=False)
        return RayPipelineExecutor(pipeline, tasks=tasks, workers=cfg.workers or tasks, logging_dir=str(logging_dir),
                                   mem_per_cpu_gb=1)
    from datatrove.executor import LocalPipelineExecutor

    workers = min(tasks, cfg.workers or os.cpu_count() or 1)
    return LocalPipelineExecutor(pipeline, tasks=tasks, workers=workers, logging_dir=str(logging_dir),
                                 start_method="fork" if hasattr(os, "fork") else "spawn")


def _assemble(params: Params, parts: int, work: Path, out: Path) -> tuple[ValidationReport, ValidationReport, dict]:
    cfg, principles = params.validate_cfg, _principles(params, Path.cwd())
    source_gate, repeats_gate = SourceGate(cfg), SourceGate(cfg, checks={_DUPLICATES})
    cleaned_gate = CleanedGate(principles, cfg.min_rows)
    seen_source, seen_cleaned = SeenHashes(), SeenHashes()
    shards, cleaning, sources = ShardWriter(out, int(cfg.shard_mb * 1e6)), {}, Counter()
    for index in range(parts):
        files = _part_files(work, index)
        counts = json.loads(Path(files["counts"]).read_text())
        source_gate.absorb(counts["gate"])
        cleaning = add_counts(cleaning, counts["cleaning"])
        for raw in _arrow_batches(files["raw"], cfg.batch_rows):
            present = raw.column(HASH).is_valid().to_numpy(zero_copy_only=False)
            hashes = raw.column(HASH).fill_null(0).to_numpy()
            flags = np.full(len(present), None, dtype=object)
            flags[present] = seen_source.add_hashes(hashes[present])
            repeats_gate.add(pd.DataFrame({TEXT: raw.column(PREVIEW).to_pylist(), REPEATS: flags}))
        for batch in _arrow_batches(files["clean"], cfg.batch_rows):
            rows = batch.to_pandas()
            if params.data.dedup:
                repeated = seen_cleaned.add_hashes(batch.column(HASH).to_numpy())
                cleaning["duplicates_removed"] += int(repeated.sum())
                rows = rows[~repeated].reset_index(drop=True)
            cleaned_gate.add(rows)
            shards.write(rows[TEXT].tolist())
            if SOURCE in rows:
                sources.update(rows[SOURCE])
    source_gate.absorb(repeats_gate.state(), rows_follow=False)  # the same rows, the one expectation they lacked
    index = shards.close()
    cleaning["documents_kept"] = index["documents"]
    rest = {"cleaning": cleaning, "shards": len(index["shards"]), "bytes": index["bytes"]}
    if sources:
        rest["sources"] = dict(sources)
    return source_gate.report(), cleaned_gate.report(), rest


def _part_checks(cfg) -> set[str]:
    return set(source_check_names(cfg)) - {_DUPLICATES}


def _raw_rows(batch: pd.DataFrame) -> pa.Table:
    """Per source row: the hash of its text (null for a null text) and its first characters, as an example shows
    them: what the "duplicates" expectation needs from the whole corpus."""
    text = batch[TEXT]
    present = text.notna().to_numpy()
    hashes = np.zeros(len(text), dtype=np.uint64)
    hashes[present] = text_hashes(text[present].tolist())
    return pa.table({HASH: pa.array(hashes, mask=~present), PREVIEW: pa.array([clip_example(t) for t in text],
                                                                              type=pa.string())})


def _cleaned_rows(cleaned: pd.DataFrame, principles: list[Principle]) -> pa.Table:
    columns = {TEXT: pa.array(cleaned[TEXT].tolist(), type=pa.large_string()),
               HASH: pa.array(text_hashes(cleaned[TEXT].tolist()), type=pa.uint64())}
    for principle in principles:
        name = violation_column(principle.name)
        columns[name] = pa.array(cleaned[name].to_numpy(bool), type=pa.bool_())
    if SOURCE in cleaned:
        columns[SOURCE] = pa.array(cleaned[SOURCE].astype(str).tolist(), type=pa.string())
    return pa.table(columns)


def _arrow_batches(path: str, rows: int):
    """A part's rows as Arrow record batches of at most `rows` rows (none when the part had no rows)."""
    if Path(path).exists():
        yield from pq.ParquetFile(path).iter_batches(batch_size=rows)


def _part_files(work: Path, index: int) -> dict[str, str]:
    stem = Path(work) / f"part-{index:05d}"
    return {"raw": f"{stem}.source.parquet", "raw.tmp": f"{stem}.source.parquet.tmp",
            "clean": f"{stem}.cleaned.parquet", "clean.tmp": f"{stem}.cleaned.parquet.tmp",
            "counts": f"{stem}.json"}


def _work_dir(params: Params, root: Path, out: Path) -> Path:
    """Where the tasks write, named by what their results depend on: the params, the constitution, the code and
    the size and time of every file the corpus is read from. A killed run's finished parts are reused only when all
    of these match."""
    digest = hashlib.sha256(b"".join(section.model_dump_json().encode()
                                     for section in (params.data, params.validate_cfg, params.constitution)))
    code = sorted(Path(__file__).parent.glob("*.py"))
    inputs = [root / params.constitution.path] if params.constitution.path else []
    for path in code + inputs:
        digest.update(path.read_bytes())
    for file in source_files(params.data, root):
        stat = file.stat()
        digest.update(f"{file}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return out.parent / f".{out.name}.work" / digest.hexdigest()[:16]


def _principles(params: Params, root: Path) -> list[Principle]:
    path = params.constitution.path
    return load_constitution(root / path) if path else []


