"""Fine-tuning and alignment quality for their params, paired by seed: what a change to the finetune or align
stage (or to the train.* settings they inherit: precision, optimizer, Adam's β₂, clipping) does to their
held-out scores.

The real stages run in a copy of this project, as `dvc repro` runs them: validate, tokenizer and prepare on the first
90% of the embedded corpus (the Python language reference, which the embedded fine-tuning pairs ask about), then
train for --pretrain-steps with the shipped params (300, the shipped train.max_steps: the model the finetune and
align defaults were measured on). With --stage finetune, the finetune stage then runs once per variant and seed from
that model (finetune.init_from=artifacts/model), and a row is its held-out answer loss (nats, the stage's
`ft_response_loss`). With --stage align, the model is first fine-tuned once with the shipped params,
then the align stage runs once per variant and seed from it, and a row is its held-out preference loss (bits, the
stage's `align_preference_bits`) with its reward accuracy. Both stages keep their best held-out pass's weights and
score those: the same rule for every row, so rows compare; the absolute figures are optimistic by that selection.

    .venv/bin/python benchmarks/post_training_quality.py [--stage finetune|align] [--pretrain-steps 300]
        [--seeds 0,1,2] [--set key=value ...] [--variant NAME=key=value[,key=value] ...] [--workdir DIR]

--set adds params to every post-training run (not to pretraining); --variant names a further run per seed with its
own params (e.g. --variant b08=finetune.beta1=0.8). --workdir keeps the prepared copy (budget_quality.py's rule: reused
where corpus, data-side params and data-side code match); the base model is trained afresh in each invocation.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from budget_quality import corpus_text, kept_project, paired  # noqa: E402
from tests.e2e_helpers import sh  # noqa: E402

from ultrathink.config import load_params  # noqa: E402

# What each stage reports on its held-out pairs (lower is better), and what else a row prints.
SCORES = {"finetune": ("ft_response_loss", ("ft_response_bpb",)),
          "align": ("align_preference_bits", ("align_reward_accuracy", "align_likelihood_accuracy"))}


def sets(options: list[str]) -> list[str]:
    return sum((["--set", o] for o in options), [])


def fresh_run(project: Path, stage: str, options: list[str]) -> dict:
    """One run of the stage with nothing of an earlier one (checkpoints, plan book, output), and its report: where
    the project's params put them."""
    p = load_params(project / "params.yaml", options).paths
    out, checkpoints, plan, report = {
        "finetune": (p.finetuned_dir, p.finetune_checkpoint_dir, p.finetune_plan, p.finetune_report),
        "align": (p.aligned_dir, p.align_checkpoint_dir, p.align_plan, p.align_report)}[stage]
    for path in (project / out, project / checkpoints, project / plan):
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    started = time.perf_counter()
    sh([sys.executable, "-m", f"tasks.{stage}", "--set", f"{stage}.enabled=true", *sets(options)], project)
    return {**json.loads((project / report).read_text()), "wall_seconds": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", choices=sorted(SCORES), default="finetune")
    parser.add_argument("--pretrain-steps", type=int, default=300)
    parser.add_argument("--seeds", type=lambda v: [int(s) for s in v.split(",")], default=[0, 1, 2])
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--variant", dest="variants", action="append", default=[])
    parser.add_argument("--workdir", type=Path)
    args = parser.parse_args()
    variants = [("defaults", [])] + [(v.split("=", 1)[0], v.split("=", 1)[1].split(",")) for v in args.variants]
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="post_training_quality-"))
    text = corpus_text("embedded")
    project = kept_project(workdir / "embedded", text[: int(len(text) * 0.9)], None, [])
    sh([sys.executable, "-m", "tasks.train", "--set", "train.budget=null",
        "--set", f"train.max_steps={args.pretrain_steps}"], project)
    print(f"base: {args.pretrain_steps} steps of the shipped params on the embedded corpus; "
          f"post-training params: {' '.join(args.overrides) or '(the shipped ones)'}", flush=True)
    if args.stage == "align":  # the model to align: fine-tuned once, with the shipped params
        fresh_run(project, "finetune", ["finetune.init_from=artifacts/model"])
    start = {"finetune": "finetune.init_from=artifacts/model", "align": "align.init_from=artifacts/finetuned"}
    score, others = SCORES[args.stage]
    rows = []
    for name, options in variants:
        for seed in args.seeds:
            report = fresh_run(project, args.stage, [start[args.stage], f"{args.stage}.seed={seed}",
                                                     *args.overrides, *options])
            rows.append({"variant": name, "seed": seed, "score": report[score],
                         **{k: report[k] for k in others}, "seconds": report["wall_seconds"]})
            extra = ", ".join(f"{k} {report[k]:.4f}" for k in others)
            print(f"{args.stage} {name:>12} seed {seed}  {score} {report[score]:.4f} ({extra}; "
                  f"{report['wall_seconds']:.0f} s)", flush=True)
    print(f"\nvariant | {score} (mean ± sd) | minus defaults, paired by seed (mean ± standard error)")
    defaults = {r["seed"]: r["score"] for r in rows if r["variant"] == "defaults"}
    for name, _ in variants:
        scores = {r["seed"]: r["score"] for r in rows if r["variant"] == name}
        spread = f" ± {statistics.stdev(scores.values()):.4f}" if len(scores) > 1 else ""
        difference = paired(scores, defaults) if name != "defaults" else None
        print(f"{name} | {statistics.mean(scores.values()):.4f}{spread} | {difference or ''}")


if __name__ == "__main__":
    main()
