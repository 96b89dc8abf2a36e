"""validate: read the corpus in batches, gate the source as loaded with the Great Expectations suite, clean it
(normalize, filter, apply the constitution, de-duplicate), gate the cleaned corpus against the constitution, and
write the validated corpus as Parquet shards with an index (ultrathink.data.shards) and a report
(reports/validate.json: the source gate's results, `cleaning` counts per step and per principle, `cleaned` gate
results, and documents per source for a mixture).

Bounded memory, in parallel: the corpus's parts (one per file of a glob) are gated and cleaned a batch of
`validate.batch_rows` documents at a time by tasks of a datatrove executor (`validate.executor`: local processes, or
Ray), then put together in corpus order, where duplicates are found by hash (ultrathink.data.engine). The suites'
results are summed over batches and parts (ultrathink.data.validation.Gate). The shards are written beside the output
and replace it only when both gates pass, so a failed corpus leaves no output that looks complete."""

import hashlib
import tempfile
from pathlib import Path

from filelock import FileLock

from ultrathink.config import Params
from ultrathink.data.constitution import load_constitution
from ultrathink.data.engine import validate_in_parts
from ultrathink.data.validation import CorpusValidationError
from ultrathink.io import atomic_dir, atomic_write_json


def run(params: Params) -> None:
    path = params.constitution.path
    if path:
        load_constitution(path)  # a broken constitution fails before any data is read
    with run_lock(params.paths.validated_corpus), atomic_dir(params.paths.validated_corpus) as out:
        report, checked, rest = validate_in_parts(params, out)
        if not report.success:
            atomic_write_json(params.paths.validate_report, report.to_dict())
            raise CorpusValidationError(report)
        atomic_write_json(params.paths.validate_report,
                          report.to_dict() | {"cleaning": rest["cleaning"], "cleaned": checked.to_dict()} | rest)
        if not checked.success:
            raise CorpusValidationError(checked)
    cleaning = rest["cleaning"]
    print(f"validate: passed {len(report.results)} + {len(checked.results)} expectations; "
          f"{cleaning['documents_kept']} of {cleaning['documents_in']} documents kept "
          f"({cleaning['duplicates_removed']} duplicates removed) in {rest['shards']} shard(s), "
          f"{rest['bytes']:,} bytes")


def run_lock(output: str) -> FileLock:
    """One validate at a time per output: two at once would share the work directory of the same inputs (and the
    first to finish removes it). The lock file lives in the temp dir, not in the project."""
    key = hashlib.sha256(str(Path(output).resolve()).encode()).hexdigest()[:16]
    return FileLock(Path(tempfile.gettempdir()) / f"ultrathink-validate-{key}.lock")

