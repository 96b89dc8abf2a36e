"""prepare: tokenize the validated corpus and pack it into flat train/val token files with their counts, then check
the packed files (ids below vocab size, no empty documents, no document in both splits): the report goes to
`prepare.report_dir` (token_report.json and token_report.html)."""

from pathlib import Path

from ultrathink.config import Params
from ultrathink.data.packing import prepare_splits


def run(params: Params) -> None:
    p = params.paths
    stats = prepare_splits(Path(p.validated_corpus), Path(p.tokenizer_dir), params.prepare, Path(p.prepared_dir),
                           report_dir=Path(params.prepare.report_dir))
    print(f"prepare: train {stats['train']['tokens']:,} tokens, val {stats['val']['tokens']:,} tokens "
          f"({params.prepare.split} split); token checks passed, report in {params.prepare.report_dir}")

