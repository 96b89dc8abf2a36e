"""Which shape a time budget's plan picks on this machine, and how often: the train stage's own planning step
(`plan.plan_run`, with its probes of throwaway models) decided afresh `--plans` times in one process, nothing trained.
The pick depends on the speeds the probes happen to meet, so one plan says little on a machine whose pace moves.

A project prepared by `budget_quality.py --workdir DIR --corpus FILE --prepare-only` is the input (DIR/<corpus>/<key>/
project: its params.yaml and prepared tokens); `--set` overrides its params as the train stage's `--set` does, after
`train.budget`. To weigh a change to the sizing rule (a constant of `ultrathink/train/sizing.py`, say), run this script
from a clone that has the change and from this checkout in turn, alternating, so that both meet the machine's spells
alike: each imports its own checkout's package. Judging such a change by recomputing `sizing.best_measured` over the
shapes logged plans measured misses what matters: the rule also decides which shapes get measured.

    .venv/bin/python benchmarks/plan_picks.py --project DIR [--budget 2min] [--plans 6] [--set key=value ...]

Prints one line per plan (the pick, its batch, dropout and weight decay, its steps, the seconds its probes took from
the budget, and each measured shape with the tokens its measured speed buys and the loss the law predicts for them),
then how often each shape was picked.
"""

from __future__ import annotations

import argparse
import collections
import logging
import sys
import time
from pathlib import Path

import torch

# This checkout's package, not an editable install of another clone (train_throughput.py says why).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ultrathink.config import Budget, load_params  # noqa: E402
from ultrathink.data.tokens import load_split, read_meta  # noqa: E402
from ultrathink.device import resolve_device  # noqa: E402
from ultrathink.train import sizing  # noqa: E402
from ultrathink.train.plan import plan_run  # noqa: E402
from ultrathink.train.precision import keep_freed_host_memory, use_deterministic_kernels  # noqa: E402


def named(shape: dict) -> str:
    return f"d{shape['d_model']}x{shape['n_layers']}"


def describe(plan) -> tuple[str, str]:
    """The pick's name, and the plan as one line."""
    chosen = plan.sizing
    measured = ", ".join(f"{named(m['shape'])} batch {m['batch_size']}: {m['tokens'] / 1e6:.2f}M tokens, "
                         f"predicted {m['predicted_loss']:.4f}" for m in chosen["measured"])
    pick = named(chosen["shape"])
    return pick, (f"{pick} batch {chosen['batch_size']}, dropout {chosen['dropout']}, weight decay "
                  f"{plan.weight_decay}, {plan.max_steps} steps, probes {plan.probe.seconds:.1f} s | {measured}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--project", type=Path, required=True, help="a project budget_quality.py prepared")
    parser.add_argument("--budget", default="2min", help="train.budget (a time budget: the plan probes)")
    parser.add_argument("--plans", type=int, default=6)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    if Budget.parse(args.budget).kind != "seconds":
        parser.error(f"--budget {args.budget}: not a time budget (30s, 2min, 1h): only a time budget's plan probes "
                     "shapes at this machine's speed")

    params = load_params(args.project / "params.yaml", [f"train.budget={args.budget}", *args.overrides])
    if params.model.size != "auto":
        parser.error("model.size is not auto in these params: the plan would pick no shape")
    cfg = params.train
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    keep_freed_host_memory()  # as the train stage steps: the probes' timings depend on it
    use_deterministic_kernels(cfg.deterministic)
    prepared = args.project / params.paths.prepared_dir
    vocab_size = read_meta(prepared)["vocab_size"]
    train_tokens, val_tokens = load_split(prepared, "train"), load_split(prepared, "val")
    device = str(resolve_device())  # the train stage's: the GPU when torch sees one
    logging.basicConfig(level=logging.ERROR)  # the plan's own lines would bury the table

    print(f"{sizing.__file__}: R* {sizing.REPEAT_DECAY}, R*_D {sizing.DROPOUT_REPEAT_DECAY}; "
          f"{len(train_tokens):,} training tokens, vocabulary {vocab_size}, {args.budget} on {device}")
    picks = collections.Counter()
    for number in range(1, args.plans + 1):
        started = time.perf_counter()
        decided = plan_run(params.model, cfg, vocab_size, train_tokens, val_tokens, device)
        pick, line = describe(decided.plan)
        picks[pick] += 1
        print(f"plan {number} ({time.perf_counter() - started:.1f} s): {line}", flush=True)
    print("picks: " + ", ".join(f"{shape} {count}" for shape, count in picks.most_common()))


if __name__ == "__main__":
    main()
