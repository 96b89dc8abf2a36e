"""validate: read the corpus in batches, gate the source as loaded with the Great Expectations suite, clean it
(normalize, filter, apply the constitution, de-duplicate), gate the cleaned corpus against the constitution, and
write the validated corpus as Parquet shards with an index (ultrathink.data.shards) and a report
(reports/validate.json: the source gate's results, `cleaning` counts per step and per principle, `cleaned` gate
results, and documents per source for a mixture).

One pass in bounded memory: a batch of `validate.batch_rows` documents is checked, cleaned and written before the
next is read; the suites' results are summed over the batches (ultrathink.data.validation.Gate) and duplicates are
found by hash across them (SeenHashes). The shards are written beside the output and replace it only when both gates
pass, so a failed corpus leaves no output that looks complete."""

from collections import Counter
from pathlib import Path

from ultrathink.cli import stage_entry
from ultrathink.config import Params
from ultrathink.data.cleaning import SeenHashes, clean_corpus
from ultrathink.data.constitution import load_constitution
from ultrathink.data.shards import ShardWriter
from ultrathink.data.sources import SOURCE, corpus_batches
from ultrathink.data.validation import CleanedGate, CorpusValidationError, SourceGate
from ultrathink.io import atomic_dir, atomic_write_json


def add_counts(total: dict, counts: dict) -> dict:
    """Sum nested count dicts (the cleaning report of each batch); labels (a principle's action) are kept."""
    for key, value in counts.items():
        if isinstance(value, dict):
            total[key] = add_counts(total.get(key, {}), value)
        else:
            total[key] = value if isinstance(value, str) else total.get(key, 0) + value
    return total


def run(params: Params) -> None:
    path, cfg = params.constitution.path, params.validate_cfg
    principles = load_constitution(path) if path else []  # a broken constitution fails before any data is read
    source_gate, cleaned_gate, seen = SourceGate(cfg), CleanedGate(principles, cfg.min_rows), SeenHashes()
    cleaning, sources = {}, Counter()
    with atomic_dir(params.paths.validated_corpus) as out:
        shards = ShardWriter(out, int(cfg.shard_mb * 1e6))
        for batch in corpus_batches(params.data, Path("."), cfg.batch_rows):
            source_gate.add(batch)
            cleaned, counts = clean_corpus(batch.dropna(subset=["text"]), params.data, principles, seen)
            cleaning = add_counts(cleaning, {**counts, "documents_in": len(batch)})
            cleaned_gate.add(cleaned)
            shards.write(cleaned["text"].tolist())
            if SOURCE in cleaned:
                sources.update(cleaned[SOURCE].astype(str))
        index = shards.close()
        report = source_gate.report()
        if not report.success:
            atomic_write_json(params.paths.validate_report, report.to_dict())
            raise CorpusValidationError(report)
        checked = cleaned_gate.report()
        full = report.to_dict() | {"cleaning": cleaning, "cleaned": checked.to_dict(),
                                   "shards": len(index["shards"]), "bytes": index["bytes"]}
        if sources:
            full["sources"] = dict(sources)
        atomic_write_json(params.paths.validate_report, full)
        if not checked.success:
            raise CorpusValidationError(checked)
    print(f"validate: passed {len(report.results)} + {len(checked.results)} expectations; "
          f"{cleaning['documents_kept']} of {cleaning['documents_in']} documents kept "
          f"({cleaning['duplicates_removed']} duplicates removed) in {len(index['shards'])} shard(s), "
          f"{index['bytes']:,} bytes")


if __name__ == "__main__":
    stage_entry("validate")
