"""Does a time budget's measuring run end on its budget? The real stages (validate, tokenizer, prepare once per run
length, as the auto vocabulary follows it; then train once per budget) in a copy of this project, with
`train.budget`, `model.size: auto` and `tokenizer.vocab_size: auto`, as a user runs them. For each budget it prints
what the budget pays for — the plan's probe and the training loop (validation passes and checkpoints included) —
against the budget, the steps the run re-planned to while training, and the stage's wall time with its start-up.

    .venv/bin/python benchmarks/budget_accuracy.py [--corpus ../shared/data/tinyshakespeare.txt]
        [--budgets 30s 2min 5min] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.e2e_helpers import make_project, set_params, sh  # noqa: E402

from ultrathink.config import Budget  # noqa: E402
from ultrathink.tokenizer import run_length  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"


def prepared_project(tmp: Path, corpus: str, budget: str | None, overrides: list[str]) -> Path:
    """A copy of this project with `corpus` (text) as its data source, validated, tokenized and prepared. With a
    budget the vocabulary and the model are sized for it; without one (equal-step runs) the model is manual and the
    vocabulary the shipped params' unless `overrides` set tokenizer.vocab_size."""
    project = make_project(tmp)
    (project / "data" / "raw").mkdir(parents=True, exist_ok=True)
    (project / "data" / "raw" / "corpus.txt").write_text(corpus, encoding="utf-8")
    shutil.copy(ROOT / "params.yaml", project / "params.yaml")  # the shipped params, not the tests' tiny ones
    sized = ({"tokenizer": {"vocab_size": "auto"}, "model": {"size": "auto"}, "train": {"budget": budget}} if budget
             else {"model": {"size": "manual"}})
    set_params(project, {"data": {"source": "data/raw/corpus.txt"}, **sized})
    for stage in ("validate", "tokenizer", "prepare"):
        sh([sys.executable, "-m", f"tasks.{stage}", *sum((["--set", o] for o in overrides), [])], project)
    return project


def train(project: Path, budget: str, overrides: list[str]) -> dict:
    started = time.perf_counter()
    sh([sys.executable, "-m", "tasks.train", "--set", f"train.budget={budget}",
        *sum((["--set", o] for o in overrides), [])], project)
    stage_seconds = time.perf_counter() - started
    facts = json.loads((project / "reports" / "train_run.json").read_text())
    book = json.loads((project / "plans" / "train.json").read_text())  # it may hold other machines' plans too
    (plan,) = [p for p in book[facts["machine"]]["plans"].values() if p["budget"] == budget]
    amount = Budget.parse(budget).amount
    spent = plan["probe"]["seconds"] + facts["seconds"]
    return {"budget": budget, "probe_s": plan["probe"]["seconds"], "train_s": facts["seconds"], "spent_s": spent,
            "ratio": spent / amount, "replans": plan["replans"], "steps": plan["max_steps"],
            "stage_s": stage_seconds, "shape": plan["sizing"]["shape"], "batch": plan["sizing"]["batch_size"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=SHAKESPEARE)
    parser.add_argument("--budgets", nargs="+", default=["30s", "2min", "5min"])
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    args = parser.parse_args()
    corpus = args.corpus.read_text(encoding="utf-8")
    with tempfile.TemporaryDirectory(prefix="ultrathink-budget-") as tmp:
        projects: dict[str, Path] = {}  # one prepared copy per run length: the auto vocabulary follows it
        for budget in args.budgets:
            length = run_length(budget)
            if length not in projects:
                projects[length] = prepared_project(Path(tmp) / length.replace(" ", "_"), corpus, budget,
                                                    args.overrides)
        rows = [train(projects[run_length(budget)], budget, args.overrides) for budget in args.budgets]
    print(f"\n{'budget':>7} {'probe s':>8} {'train s':>8} {'spent s':>8} {'spent/budget':>13} {'steps':>6} "
          f"{'stage s':>8}  re-plans (step → steps)   shape")
    for r in rows:
        s = r["shape"]
        print(f"{r['budget']:>7} {r['probe_s']:8.1f} {r['train_s']:8.1f} {r['spent_s']:8.1f} {r['ratio']:13.3f} "
              f"{r['steps']:6d} {r['stage_s']:8.1f}  {', '.join(f'{a}→{b}' for a, b in r['replans']) or 'none':24} "
              f"d{s['d_model']}×{s['n_layers']} seq {s['seq_len']} batch {r['batch']}")


if __name__ == "__main__":
    main()
