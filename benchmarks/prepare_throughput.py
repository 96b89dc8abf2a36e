"""Prepare throughput and peak memory on a ~200 MB corpus (a benchmark, not a test).

Builds the corpus in a temp dir from ../shared/data/tinyshakespeare.txt (read in place, never copied into the
repo): its paragraphs, repeated with a per-copy rotation and a copy-number prefix so that no two documents are equal,
written as the validated-corpus JSON Lines. Trains a tokenizer on the original text, then runs the real prepare path
(`prepare_splits`: split plan, process-pool tokenization, incremental token files, token checks) and prints MB/s,
tokens/s and peak RSS of this process and of the worker processes (resource.getrusage).

    .venv/bin/python benchmarks/prepare_throughput.py [--mb 200] [--workers N]
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ultrathink.config import PrepareConfig, TokenizerConfig  # noqa: E402
from ultrathink.data.packing import prepare_splits  # noqa: E402
from ultrathink.data.sources import split_paragraphs  # noqa: E402
from ultrathink.tokenizer import train_tokenizer  # noqa: E402

SOURCE = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"  # ../shared


def build_corpus(path: Path, target_bytes: int) -> int:
    """Write perturbed copies of the source's paragraphs as JSON Lines until `target_bytes` of text; return them."""
    paragraphs = split_paragraphs(SOURCE.read_text(encoding="utf-8"))
    written, copy = 0, 0
    with open(path, "w", encoding="utf-8") as out:
        while written < target_bytes:
            shift = (copy * 7919) % len(paragraphs)
            for paragraph in paragraphs[shift:] + paragraphs[:shift]:
                text = f"[{copy}] {paragraph}"
                out.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
                written += len(text.encode("utf-8"))
            copy += 1
    return written


def peak_rss_mb(who: int) -> float:
    return resource.getrusage(who).ru_maxrss / 1024  # Linux reports KiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=200, help="corpus size in MB of text")
    parser.add_argument("--workers", type=int, default=None, help="tokenizer processes (default: all cores)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ultrathink-bench-") as tmp:
        tmp = Path(tmp)
        text_bytes = build_corpus(tmp / "corpus.jsonl", int(args.mb * 1e6))
        train_tokenizer(split_paragraphs(SOURCE.read_text(encoding="utf-8")), TokenizerConfig(), tmp / "tokenizer")
        rss_before = peak_rss_mb(resource.RUSAGE_SELF)
        start = time.perf_counter()
        meta = prepare_splits(tmp / "corpus.jsonl", tmp / "tokenizer", PrepareConfig(workers=args.workers),
                              tmp / "prepared", report_dir=tmp / "report")
        seconds = time.perf_counter() - start
    tokens = meta["train"]["tokens"] + meta["val"]["tokens"]
    documents = meta["train"]["documents"] + meta["val"]["documents"]
    print(f"corpus: {text_bytes / 1e6:.1f} MB of text, {documents:,} documents, {tokens:,} tokens")
    print(f"prepare: {seconds:.1f} s, {text_bytes / 1e6 / seconds:.2f} MB/s, {tokens / seconds:,.0f} tokens/s "
          f"(workers: {args.workers or 'all cores'})")
    print(f"peak RSS: main process {peak_rss_mb(resource.RUSAGE_SELF):.0f} MB (before prepare {rss_before:.0f} MB), "
          f"largest worker {peak_rss_mb(resource.RUSAGE_CHILDREN):.0f} MB")


if __name__ == "__main__":
    main()
