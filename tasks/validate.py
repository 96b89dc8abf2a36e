"""validate: load the corpus, gate the source as loaded with the Great Expectations suite, clean it (normalize,
filter, apply the constitution, de-duplicate), gate the cleaned corpus against the constitution, and write the
validated corpus and a report (reports/validate.json: the source gate's results, `cleaning` counts per step and
per principle, `cleaned` gate results, and documents per source for a mixture)."""

import json
from pathlib import Path

from ultrathink.cli import stage_entry
from ultrathink.config import Params
from ultrathink.data.cleaning import clean_corpus
from ultrathink.data.constitution import load_constitution
from ultrathink.data.sources import SOURCE, load_corpus
from ultrathink.data.validation import CorpusValidationError, validate_cleaned, validate_corpus
from ultrathink.io import atomic_write_json, atomic_write_text


def run(params: Params) -> None:
    path = params.constitution.path
    principles = load_constitution(path) if path else []  # a broken constitution fails before any data is read
    corpus = load_corpus(params.data, Path("."))
    report = validate_corpus(corpus, params.validate_cfg)
    if not report.success:
        atomic_write_json(params.paths.validate_report, report.to_dict())
        raise CorpusValidationError(report)
    corpus, cleaning = clean_corpus(corpus, params.data, principles)
    cleaned = validate_cleaned(corpus, principles, params.validate_cfg.min_rows)
    full = report.to_dict() | {"cleaning": cleaning, "cleaned": cleaned.to_dict()}
    if SOURCE in corpus:
        full["sources"] = {str(k): int(v) for k, v in corpus[SOURCE].value_counts(sort=False).items()}
    atomic_write_json(params.paths.validate_report, full)
    if not cleaned.success:
        raise CorpusValidationError(cleaned)
    lines = (json.dumps({"text": text}, ensure_ascii=False) for text in corpus["text"])
    atomic_write_text(params.paths.validated_corpus, "\n".join(lines) + "\n")
    print(f"validate: passed {len(report.results)} + {len(cleaned.results)} expectations; "
          f"{cleaning['documents_kept']} of {cleaning['documents_in']} documents kept "
          f"({cleaning['duplicates_removed']} duplicates removed)")


if __name__ == "__main__":
    stage_entry("validate")
