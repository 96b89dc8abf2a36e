"""validate: load the corpus, gate it with the Great Expectations suite, write the validated corpus and a report."""

import json
from pathlib import Path

from ultrathink.cli import stage_entry
from ultrathink.config import Params
from ultrathink.data.cleaning import drop_exact_duplicates
from ultrathink.data.sources import load_corpus
from ultrathink.data.validation import CorpusValidationError, validate_corpus
from ultrathink.io import atomic_write_json, atomic_write_text


def run(params: Params) -> None:
    corpus = load_corpus(params.data, Path("."))
    report = validate_corpus(corpus, params.validate_cfg)
    if not report.success:
        atomic_write_json(params.paths.validate_report, report.to_dict())
        raise CorpusValidationError(report)
    removed = 0
    if params.data.dedup:
        corpus, removed = drop_exact_duplicates(corpus)
    atomic_write_json(params.paths.validate_report,
                      report.to_dict() | {"cleaning": {"duplicates_removed": removed, "documents_kept": len(corpus)}})
    lines = (json.dumps({"text": text}, ensure_ascii=False) for text in corpus["text"])
    atomic_write_text(params.paths.validated_corpus, "\n".join(lines) + "\n")
    print(f"validate: passed {len(report.results)} expectations; {removed} duplicates removed, "
          f"{len(corpus)} documents kept")


if __name__ == "__main__":
    stage_entry("validate")
