"""Validate and prepare on a corpus larger than the memory they are given: MB/s and peak RSS per stage, beside the
in-memory path the validate stage had before (load the corpus as one DataFrame, run the suite on it, clean it, write
one JSON-lines file) on a corpus both can handle.

    python benchmarks/validate_memory.py --mb 300 --compare --prepare   # both paths side by side
    python benchmarks/validate_memory.py --mb 4000 --prepare            # the bounded path alone, 4 GB

Each path runs in its own process (the real stage code: tasks.validate, tasks.prepare), so its peak RSS is its own;
prepare's tokenizer workers are processes too, and the largest of them is reported. The corpus: JSON lines of
English-like documents of 200 to 3000 characters from a fixed vocabulary, 5% of them exact repeats, 0.1% with an
e-mail address (redacted by the constitution)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("the of and to in is that for it as with was on be by this are from or have an they which one you were her "
         "all she there would their we him been has when who will more no if out so said what up its about into than "
         "them can only other new some could time these two may then do first any my now such like our over man me "
         "even most made after also did many before must through back years where much your way well down should "
         "because each just those people how too little state good very make world still own see men work long get "
         "here between both life being under never day same another know while last might us great old year off "
         "come since against go came right used take three").split()


def write_corpus(directory: Path, megabytes: float, files: int = 1, seed: int = 0) -> tuple[int, int]:
    """JSON lines until `megabytes` of text, in `files` files of about equal size (part-NNN.jsonl, blocks of 1000
    documents dealt in turn); returns (documents, bytes)."""
    rng = np.random.default_rng(seed)
    words = np.array(WORDS)
    target, written, documents, recent = int(megabytes * 1e6), 0, 0, []
    directory.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        outs = [stack.enter_context((directory / f"part-{i:03d}.jsonl").open("w", encoding="utf-8"))
                for i in range(files)]
        while written < target:
            lengths = rng.integers(40, 600, size=1000)
            picks = rng.integers(0, len(words), size=int(lengths.sum()))
            cuts = np.cumsum(lengths)[:-1]
            lines = []
            for i, chunk in enumerate(np.split(words[picks], cuts)):
                text = " ".join(chunk).capitalize() + "."
                if i % 1000 == 7:
                    text += f" Write to someone{documents + i}@example.org for more."
                if recent and i % 20 == 3:
                    text = recent[int(rng.integers(len(recent)))]  # an exact repeat of an earlier document
                lines.append(json.dumps({"text": text}) + "\n")
            recent = [json.loads(line)["text"] for line in lines[:50]]
            block = "".join(lines)
            outs[(documents // 1000) % files].write(block)
            written += len(block.encode("utf-8"))
            documents += len(lines)
    return documents, written


IN_MEMORY = """
import json, sys
from pathlib import Path
from ultrathink.config import load_params
from ultrathink.data.cleaning import clean_corpus
from ultrathink.data.constitution import load_constitution
from ultrathink.data.sources import load_corpus
from ultrathink.data.validation import validate_cleaned, validate_corpus
params = load_params("params.yaml")
principles = load_constitution(params.constitution.path)
corpus = load_corpus(params.data, Path("."))
assert validate_corpus(corpus, params.validate_cfg).success
corpus, cleaning = clean_corpus(corpus, params.data, principles)
assert validate_cleaned(corpus, principles, params.validate_cfg.min_rows).success
with open("corpus.jsonl", "w") as f:
    f.writelines(json.dumps({"text": t}, ensure_ascii=False) + "\\n" for t in corpus["text"])
"""


MEASURE = """
import resource, subprocess, sys
done = subprocess.run(sys.argv[1:], capture_output=True, text=True)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)  # KB: the largest process of the tree
sys.stderr.write(done.stdout[-2000:] + done.stderr[-3000:] if done.returncode else "")
sys.exit(done.returncode)
"""


def run_measured(args: list[str], cwd: Path) -> tuple[float, float]:
    """(seconds, peak RSS in MB of the largest process it started) for a command run in its own process tree."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", MEASURE, *args], cwd=cwd, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode:
        raise SystemExit(f"{args} failed:\n{done.stderr[-4000:]}")
    return seconds, int(done.stdout.split()[-1]) / 1024


def project(tmp: Path, corpus: Path, batch_rows: int, workers: int | None) -> Path:
    """A project dir with params pointing at the corpus (the default constitution, the default checks)."""
    for name in ("constitution.yaml", "dvc.yaml"):
        shutil.copy(ROOT / name, tmp / name)
    import yaml

    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["data"].update(source=f"{corpus}/*.jsonl", max_samples=None)
    params["validate"].update(batch_rows=batch_rows, max_duplicate_fraction=0.3, workers=workers)
    params["tokenizer"]["vocab_size"] = 4096
    (tmp / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return tmp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=200.0, help="corpus size in MB of JSON lines")
    parser.add_argument("--batch-rows", type=int, default=10_000)
    parser.add_argument("--files", type=int, default=8, help="the corpus is this many JSON-lines files (the parts "
                        "that validate's tasks share)")
    parser.add_argument("--workers", type=int, default=None, help="validate.workers (default: all cores)")
    parser.add_argument("--compare", action="store_true", help="also run the in-memory path")
    parser.add_argument("--prepare", action="store_true", help="also train a tokenizer on a sample and prepare")
    parser.add_argument("--keep", type=Path, default=None, help="work here instead of a temp dir (kept)")
    args = parser.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="ultrathink-validate-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    python = sys.executable
    env_note = f"{os.cpu_count()} cores"
    try:
        corpus = work / "raw"
        started = time.perf_counter()
        documents, size = write_corpus(corpus, args.mb, args.files)
        print(f"corpus: {size / 1e6:,.0f} MB, {documents:,} documents in {args.files} files (written in "
              f"{time.perf_counter() - started:.0f} s); {env_note}; validate.workers {args.workers or 'all cores'}")
        root = project(work, corpus, args.batch_rows, args.workers)
        rows = []
        seconds, rss = run_measured([python, "-m", "tasks.validate"], root)
        rows.append(("validate (datatrove tasks, batches, shards)", seconds, rss))
        if args.prepare:
            sample = [python, "-c", "from pathlib import Path; from itertools import islice; "
                      "from ultrathink.config import load_params; from ultrathink.data.packing import read_texts; "
                      "from ultrathink.tokenizer import train_tokenizer; p = load_params(); "
                      "train_tokenizer(islice(read_texts(Path(p.paths.validated_corpus)), 20000), p.tokenizer, "
                      "Path(p.paths.tokenizer_dir))"]
            run_measured(sample, root)
            seconds, rss = run_measured([python, "-m", "tasks.prepare"], root)
            rows.append(("prepare (reads the shards)", seconds, rss))
        if args.compare:
            seconds, rss = run_measured([python, "-c", IN_MEMORY], root)
            rows.append(("validate, in memory (the path before)", seconds, rss))
        if args.prepare:
            both = rows[0][1] + rows[1][1]
            rows.insert(2, ("validate + prepare", both, max(rows[0][2], rows[1][2])))
        print("\n| stage | seconds | MB/s | peak RSS of the largest process (MB) |\n|---|---|---|---|")
        for name, seconds, rss in rows:
            print(f"| {name} | {seconds:.1f} | {size / 1e6 / seconds:.1f} | {rss:,.0f} |")
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONPATH", str(ROOT))
    main()
