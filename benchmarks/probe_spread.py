"""How far a time budget's probe of one shape wanders on this machine, and how far two shapes' ratio does when they are
stepped side by side: what `sizing.PROBE_SPREAD` and `plan.py`'s side-by-side measurement rest on.

Two shapes (default d192 × 2 and d192 × 3, seq 128, batch 8, vocabulary 960, fp32 on a CPU without native bf16: the
2-minute tiny Shakespeare cell of the slow class) are measured for `--seconds` each way, with the functions a plan
calls:
  - one after the other: `budget.probe_shape` of the first, then of the second, and again (what the plan's probes
    do), each probe's median step;
  - side by side: `budget.step_seconds_side_by_side` of both, again and again (a step of each in turn).
It prints each shape's range of medians and the range of the second's over the first's. The token stream is random:
a step's time does not depend on which tokens it reads.

    .venv/bin/python benchmarks/probe_spread.py [--shape 192x2 --shape 192x3] [--batch 8] [--seq 128] [--vocab 960]
        [--seconds 40] [--precision fp32] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

# This checkout's package, not an editable install of another clone (train_throughput.py says why).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ultrathink.config import ModelConfig, TrainConfig  # noqa: E402
from ultrathink.train.budget import probe_shape, step_seconds_side_by_side  # noqa: E402


def configs(args) -> list[tuple[ModelConfig, TrainConfig, None]]:
    train = TrainConfig(batch_size=args.batch, precision=args.precision, attention="torch", weight_decay=0.1,
                        compile=False)
    shapes = []
    for shape in args.shape:
        width, depth = (int(x) for x in shape.split("x"))
        heads = max(1, width // 64)
        shapes.append((ModelConfig(d_model=width, n_layers=depth, n_heads=heads, n_kv_heads=heads, seq_len=args.seq,
                                   dropout=0.0), train, None))
    return shapes


def one_after_the_other(shapes, vocab: int, tokens, seconds: float) -> list[list[float]]:
    medians = [[] for _ in shapes]
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        for i, (model, train, kernel) in enumerate(shapes):
            medians[i].append(probe_shape(model, train, vocab, tokens, tokens[:4096], "cpu",
                                          kernel).step_seconds)
    return medians


def side_by_side(shapes, vocab: int, tokens, seconds: float) -> list[list[float]]:
    medians = [[] for _ in shapes]
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        steps, _ = step_seconds_side_by_side(shapes, vocab, tokens, tokens[:4096], "cpu")
        for i, step in enumerate(steps):
            medians[i].append(step)
    return medians


def report(how: str, shapes, medians: list[list[float]]) -> None:
    first, second = medians[0], medians[1]
    ratios = [b / a for a, b in zip(first, second)]
    names = [f"d{m.d_model}x{m.n_layers}" for m, _, _ in shapes]
    for name, values in zip(names, medians):
        middle = statistics.median(values)
        print(f"{how:20s} {name}: {len(values)} medians {min(values) * 1e3:.1f}-{max(values) * 1e3:.1f} ms "
              f"(middle {middle * 1e3:.1f}: {min(values) / middle - 1:+.0%} to {max(values) / middle - 1:+.0%})")
    print(f"{how:20s} {names[1]} / {names[0]}: {min(ratios):.2f}-{max(ratios):.2f} (middle "
          f"{statistics.median(ratios):.2f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", action="append", help="WIDTHxDEPTH, twice (default 192x2 and 192x3)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=960)
    parser.add_argument("--seconds", type=float, default=40.0, help="for each way of measuring")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    args.shape = args.shape or ["192x2", "192x3"]
    if len(args.shape) != 2:
        parser.error("--shape: give two shapes")
    torch.set_num_threads(args.threads)
    tokens = np.random.default_rng(0).integers(0, args.vocab, 400_000).astype(np.uint16)
    shapes = configs(args)
    print(f"batch {args.batch}, seq {args.seq}, vocabulary {args.vocab}, {args.precision}, {args.threads} threads; "
          f"{args.seconds:.0f} s each way")
    report("one after the other", shapes, one_after_the_other(shapes, args.vocab, tokens, args.seconds))
    report("side by side", shapes, side_by_side(shapes, args.vocab, tokens, args.seconds))


if __name__ == "__main__":
    main()
