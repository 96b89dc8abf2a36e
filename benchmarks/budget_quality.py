"""Quality for a budget: the pipeline with nothing but a budget set (train.budget, model.size auto, tokenizer
vocab auto) against nanoGPT's quick CPU config (a char-level GPT, 0.8M params) trained for the same seconds, both
scored on the same held-out text in bits per byte.

The corpus's first 90% (by characters) is the pipeline's data source; the last 10% is never trained on and is scored
as raw text: `ultrathink eval` for ours (its code length over the bytes of the paragraphs and of the blank lines
between them: text_bits_per_byte), every character for the char-level baseline. The pipeline runs as users
run it (`python -m tasks.<stage>` in a copy of this project, so validate, the tokenizer, prepare and train are the
real stages: prepared once per corpus, then trained afresh for each budget and variant, with no checkpoint or plan
of an earlier run). `--set` adds params to every run (e.g. --set train.precision=fp32); `--variant` names a further
run per budget with its own params (e.g. --variant qk=model.qk_norm=false), to compare ideas at equal wall-clock;
a variant that sets data-side keys (data.*, validate.*, constitution.*, tokenizer.*, prepare.*; e.g.
tokenizer.vocab_size=1024) trains on a copy prepared with them.

The baseline is nanoGPT's README CPU run of shakespeare_char, given the same seconds the way a user with this
machine would set `max_iters`: its step is timed first and its iteration count (and so its cosine decay) fitted to
the seconds, at most the README's 2000. It runs where the train stage runs: on the GPU when torch sees one.

    .venv/bin/python benchmarks/budget_quality.py [--corpus FILE|embedded ...] [--budget 2min ...]
        [--set key=value ...] [--variant NAME=key=value[,key=value] ...] [--skip-baseline] [--match 2min]
        [--repeats N] [--seeds 1337,1,2] [--grid] [--workdir DIR [--prepare-only]]

--match 2min: the baseline trains for 2 minutes on each corpus and every budget of ours is compared with that score
(time to quality). --grid trains once per optimizer × schedule (AdamW, Muon, Lion × cosine, WSD) at the same budget.
--workdir DIR keeps the prepared copies in DIR (else a temporary folder) and reuses one whose corpus, data-side params,
data-side code (the module closures of the validate, tokenizer and prepare stages, params.yaml and
constitution.yaml) and sizing (for a time budget of its length: the vocabulary follows it; or for equal steps) are
those that made it, refreshing its training code from this checkout. So a machine without Great Expectations or DVC
(a GPU image) can train on copies prepared elsewhere: it never runs the data-side stages.
--prepare-only makes (or finds) the copies and the held-out texts in --workdir and trains nothing.
--seeds 1337,1,2 runs each variant once per train.seed: at equal steps a run repeats to the last digit, so only other
seeds show an idea's noise (tiny Shakespeare at 1000 steps: ±0.016 bits/byte between seeds, benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import itertools
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from budget_accuracy import prepared_project  # noqa: E402
from reference_gpt import GPT  # noqa: E402
from tests.e2e_helpers import sh  # noqa: E402

from ultrathink.config import Budget, ModelConfig  # noqa: E402
from ultrathink.data.tokens import read_meta  # noqa: E402
from ultrathink.hashing import files_hash, json_hash  # noqa: E402
from ultrathink.lineage import module_closure  # noqa: E402
from ultrathink.device import resolve_device, synchronize  # noqa: E402
from ultrathink.registry.models import evaluate_text_file  # noqa: E402
from ultrathink.train import sizing  # noqa: E402
from ultrathink.stages.tokenizer import precision_for_vocabulary  # noqa: E402
from ultrathink.tokenizer import run_length  # noqa: E402
from ultrathink.train.engine import autocast  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
# Params the data-side stages read (dvc.yaml): a variant that sets one trains on its own prepared copy.
DATA_SIDE = ("data.", "validate.", "constitution.", "tokenizer.", "prepare.", "train.precision=")
DATA_STAGES = ("validate", "tokenizer", "prepare")
TRAINING_CODE = ("ultrathink", "tasks")  # what a reused copy takes afresh from this checkout (--workdir)
README_ITERATIONS, WARMUP = 2000, 100
# The baseline's step is timed after WARM_UP iterations (the first ones build kernels and grow buffers: several
# times slower) over WINDOWS windows of TIMED more, the fastest kept: one window on a shared core once timed the step
# 30% slow, and the baseline then trained 1481 iterations in 94 of its 120 s.
WARM_UP, TIMED, WINDOWS = 30, 60, 3


def train_and_score(project: Path, held_out: Path, budget: str, overrides: list[str]) -> dict:
    """A fresh train stage (no checkpoint or plan of an earlier run), then what `ultrathink eval --model
    artifacts/model --text-file held_out` computes; `wall_seconds`: all of it, the stage's start, probes and scoring
    included (what a device call must leave time for)."""
    started = time.perf_counter()
    for stale in ("artifacts/checkpoints", "artifacts/model", "plans"):
        shutil.rmtree(project / stale, ignore_errors=True)
    limit = (["train.budget=null", f"train.max_steps={budget.removesuffix('steps')}"] if budget.endswith("steps")
             else [f"train.budget={budget}"])
    done = sh([sys.executable, "-m", "tasks.train", *sum((["--set", o] for o in limit + overrides), [])], project)
    sizing_line = next((line for line in (done.stdout + done.stderr).splitlines() if "model.size auto:" in line), "")
    summary = json.loads((project / "artifacts" / "model" / "train_summary.json").read_text())
    scored = evaluate_text_file(str(project / "artifacts" / "model"), held_out, "paragraph", root=project,
                                tokenizer_dir=project / "artifacts" / "tokenizer").to_dict()
    seconds = json.loads((project / "reports" / "train_run.json").read_text())["seconds"]
    config = json.loads((project / "artifacts" / "model" / "config.json").read_text())
    model = ModelConfig(**config["model"])
    shape = sizing.Shape.of(model)
    _, non_embedding, _ = sizing.counts(shape, model, config["vocab_size"])
    corpus_tokens = read_meta(project / "data" / "prepared")["train"]["tokens"]
    [plan] = [p for entry in json.loads((project / "plans" / "train.json").read_text()).values()
              for p in entry["plans"].values()]  # the plans dir was emptied before this run
    return {"bpb": text_bits_per_byte(scored), "bpb_documents": scored["bits_per_byte"],
            "steps": summary["steps"], "seconds": seconds,
            "selected_step": summary["selected_step"], "averaged": summary.get("averaged", False),
            "decay_began": summary.get("decay_began"),
            "temperature": (summary.get("calibration") or {}).get("temperature"),  # train.calibrate's, folded in
            "corpus_tokens": corpus_tokens,
            "params": summary["params"], "vocab": config["vocab_size"], "non_embedding_params": non_embedding,
            "tokens": summary["steps"] * summary["plan"]["tokens_per_step"], "shape": asdict(shape),
            "batch_size": summary["plan"]["tokens_per_step"] // shape.seq_len,  # sequences a step, set or sized
            "dropout": model.dropout, "weight_decay": summary["plan"].get("weight_decay"),
            "sizing": sizing_line.split("model.size auto:")[-1].split(" — ")[0].strip(),
            "measured": plan["sizing"].get("measured", []), "wall_seconds": time.perf_counter() - started}


def text_bits_per_byte(scored: dict) -> float:
    """Bits per byte of the held-out text, as the char-level baseline is scored: our code length of it (every
    paragraph's tokens and the EOS that closes each) over the bytes that code spells out: the paragraphs and the
    blank line ("\n\n") each EOS but the last stands for. `ultrathink eval`'s yardstick (the scored dict) divides by
    the paragraphs' bytes alone: it charges the EOS predictions and credits no byte for them, where the baseline is
    charged for two newlines and credited two bytes. Where a text separates its paragraphs with more than one blank
    line or with spaces (WikiText-2's " \n \n"), the baseline is credited those bytes and we are not: only the bytes
    our code reproduces count."""
    spelled = scored["bytes"] + 2 * (scored["documents"] - 1)
    return scored["bits_per_byte"] * scored["bytes"] / spelled


class CharBaseline:
    """nanoGPT's README CPU run of shakespeare_char: 4 layers, 4 heads, 128 wide, block 64, batch 12, dropout 0,
    lr 1e-3 cosine to 1e-4 after 100 warmup iterations, AdamW betas (0.9, 0.99), in the precision given."""

    def __init__(self, train_text: str, held_out: str, precision: str):
        chars = sorted(set(train_text) | set(held_out))
        self.index = {c: i for i, c in enumerate(chars)}
        self.device = resolve_device("auto")  # the train stage's device: the GPU when there is one
        self.data = torch.tensor([self.index[c] for c in train_text], device=self.device)
        self.held_out, self.precision = held_out, precision

    def run(self, seconds: float) -> dict:
        iterations = min(README_ITERATIONS, int(seconds / self.seconds_per_iteration()))
        model, seconds_trained = self.train(iterations)
        return {"bpb": self.score(model), "iterations": iterations, "seconds": seconds_trained}

    def seconds_per_iteration(self) -> float:
        """Timed on a throwaway model after a few warm-up iterations, as a user would time a short run: the fastest
        of a few windows, so a passing stall does not shorten the baseline's run."""
        model, opt = self.fresh()
        for _ in range(WARM_UP):
            self.step(model, opt, 1e-3)
        windows = []
        for _ in range(WINDOWS):
            synchronize(self.device)
            started = time.perf_counter()
            for _ in range(TIMED):
                self.step(model, opt, 1e-3)
            synchronize(self.device)
            windows.append((time.perf_counter() - started) / TIMED)
        return min(windows)

    def fresh(self) -> tuple[GPT, torch.optim.Optimizer]:
        torch.manual_seed(1337)
        model = GPT(len(self.index), 128, 4, 4, 64).to(self.device)
        opt = model.optimizer(1e-3)
        for group in opt.param_groups:
            group["betas"] = (0.9, 0.99)
        return model, opt

    def step(self, model: GPT, opt: torch.optim.Optimizer, lr: float) -> None:
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(len(self.data) - 65, (12,)).tolist()
        x = torch.stack([self.data[s:s + 64] for s in starts])
        y = torch.stack([self.data[s + 1:s + 65] for s in starts])
        with autocast(self.precision, str(self.device)):
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def train(self, iterations: int) -> tuple[GPT, float]:
        model, opt = self.fresh()
        warmup = min(WARMUP, iterations // 10)
        started = time.perf_counter()
        for it in range(iterations):
            lr = 1e-3 * (it + 1) / warmup if it < warmup else 1e-4 + 0.5 * (1e-3 - 1e-4) * (
                1 + math.cos(math.pi * (it - warmup) / max(1, iterations - warmup)))
            self.step(model, opt, lr)
        synchronize(self.device)
        return model, time.perf_counter() - started

    def score(self, model: GPT) -> float:
        """Bits per byte of the held-out text: every character after the first predicted once, in windows of 64
        without overlap (as `ultrathink eval` does)."""
        ids = torch.tensor([self.index[c] for c in self.held_out], device=self.device)
        total = 0.0
        model.eval()
        with torch.no_grad():
            for s in range(0, len(ids) - 1, 64):
                x, y = ids[s:s + 64], ids[s + 1:s + 65]
                total += F.cross_entropy(_logits(model, x[: len(y)][None]), y, reduction="sum").item()
        return total / math.log(2) / len(self.held_out.encode("utf-8"))


def _logits(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    x = model.wte(idx) + model.wpe(torch.arange(idx.shape[1], device=idx.device))
    for block in model.blocks:
        x = block(x)
    return F.linear(model.ln_f(x), model.wte.weight)[0]


GRID = [(optimizer, schedule) for optimizer in ("adamw", "muon", "lion") for schedule in ("cosine", "wsd")]
LION_LR = 2e-4  # Lion's sign updates are larger: its paper advises 3-10× below AdamW's (2e-3 here)


def corpus_text(corpus: str) -> str:
    if corpus == "embedded":
        from ultrathink.config import DataConfig
        from ultrathink.data.sources import load_corpus

        return "\n\n".join(load_corpus(DataConfig())["text"].tolist())
    return Path(corpus).read_text(encoding="utf-8")


def variants(args) -> list[tuple[str, list[str]]]:
    extra = [(v.split("=", 1)[0], v.split("=", 1)[1].split(",")) for v in args.variants]
    if args.grid:
        extra = [(f"{o}+{s}", [f"train.optimizer={o}", f"train.schedule={s}"] + ([f"train.lr={LION_LR}"]
                                                                                   if o == "lion" else []))
                 for o, s in GRID]
    return [("defaults", [])] + [(name, sets) for name, sets in extra if name != "defaults"]


def precision_of(overrides: list[str]) -> str:
    return next((o.split("=", 1)[1] for o in overrides if o.startswith("train.precision=")), "auto")


def run_corpus(corpus: str, args, tmp: Path) -> list[dict]:
    text = corpus_text(corpus)
    cut = int(len(text) * 0.9)
    name = Path(corpus).stem

    def project_for(sets: list[str], budget: str) -> Path:
        """The copy prepared for `budget`: its vocabulary follows a time budget (tokenizer.auto_vocab_size)."""
        data_side = [o for o in args.overrides + sets if o.startswith(DATA_SIDE)]
        return kept_project(tmp / name, text[:cut], None if budget.endswith("steps") else budget, data_side)

    held_out = tmp / f"{name}-held_out.txt"
    held_out.parent.mkdir(parents=True, exist_ok=True)
    held_out.write_text(text[cut:], encoding="utf-8")
    if args.prepare_only:
        for budget, (_, sets) in itertools.product(args.budgets, variants(args)):
            print(f"{name} {budget}: prepared {project_for(sets, budget)}", flush=True)
        return []
    baseline = CharBaseline(text[:cut], text[cut:], precision_of(args.overrides))
    scores: dict[float, dict] = {}  # the baseline's, by seconds: with --match, one run serves every budget

    def baseline_for(budget: str) -> dict:
        seconds = Budget.parse(args.match or budget).amount
        if seconds not in scores:
            scores[seconds] = baseline.run(seconds)
        return scores[seconds]

    rows = []
    for budget in args.budgets:
        base = None if args.skip_baseline else baseline_for(budget)
        for variant, sets in variants(args):
            for seed, repeat in itertools.product(args.seeds or [None], range(args.repeats)):
                seeded = sets + ([] if seed is None else [f"train.seed={seed}"])
                ours = train_and_score(project_for(sets, budget), held_out, budget, args.overrides + seeded)
                rows.append({"corpus": name, "bytes": len(text[:cut].encode()), "budget": budget, "variant": variant,
                             "seed": seed, "repeat": repeat, "ours": ours, "baseline": base})
                print(row_line(rows[-1]), flush=True)
                print("row:", json.dumps(rows[-1]), file=sys.stderr, flush=True)  # for scripts: grep '^row:'

    return rows


def vocabulary_run(budget: str, overrides: list[str]) -> str:
    """What a copy's auto vocabulary is sized for (tokenizer.run_length): the budget's length and, where it matters,
    the precision the overrides' train.precision resolves to on this machine, as the tokenizer stage resolves it."""
    return run_length(budget, precision_for_vocabulary(budget, precision_of(overrides)))


def kept_project(directory: Path, train_text: str, budget: str | None, overrides: list[str]) -> Path:
    """A prepared copy of this project for `train_text` under `directory`: the one made from the same corpus,
    data-side params and data-side code, sized alike (for a time budget: vocabulary and model auto, the vocabulary
    for the budget's length; for equal steps: neither), if it is there (its training code refreshed from this
    checkout), else a new one. Its record is written last, so a copy whose preparation failed half-way is never
    reused."""
    record = {"corpus_sha256": hashlib.sha256(train_text.encode("utf-8")).hexdigest(), "overrides": overrides,
              "code": data_side_code(), "sized_for": budget and vocabulary_run(budget, overrides)}
    home = directory / json_hash(record)
    marker = home / "prepared.json"
    if marker.is_file() and json.loads(marker.read_text()) == record:
        refresh_training_code(home / "project")
        return home / "project"
    shutil.rmtree(home, ignore_errors=True)  # an unfinished copy of this very record, never another's
    project = prepared_project(home, train_text, budget, overrides)
    marker.write_text(json.dumps(record))
    return project


def data_side_code() -> str:
    """The hash of what the data-side stages run: their module closures and the files their params come from."""
    files = {path for stage in DATA_STAGES for path in module_closure(f"tasks.{stage}", ROOT)}
    return files_hash(ROOT, sorted(files) + [Path("params.yaml"), Path("constitution.yaml")])


def refresh_training_code(project: Path) -> None:
    """This checkout's Python packages over a reused copy's (stale modules removed), so training runs today's code."""
    for package in TRAINING_CODE:
        shutil.rmtree(project / package)
        shutil.copytree(ROOT / package, project / package, ignore=shutil.ignore_patterns("__pycache__"))


def row_line(row: dict) -> str:
    ours, base = row["ours"], row["baseline"]
    seed = f" seed {row['seed']}" if row.get("seed") is not None else ""
    documents = f", paragraphs alone {ours['bpb_documents']:.4f}" if "bpb_documents" in ours else ""
    line = (f"{row['corpus']:>12} {row['budget']:>6} {row['variant']:>14}{seed}  ours {ours['bpb']:.4f} "
            f"({ours['seconds']:.0f} s{documents}, {ours['steps']} steps, {ours['params'] / 1e6:.2f}M")
    if ours.get("wall_seconds") is not None:
        line += f"; {ours['wall_seconds']:.0f} s in all"
    if ours.get("decay_began") is not None:
        line += f"; a plateau at step {ours['decay_began']} began the decay"
    if ours.get("selected_step") not in (None, ours["steps"]):
        line += f"; step {ours['selected_step']}'s weights kept"
    if ours.get("averaged"):
        line += "; the weight average kept"
    if ours.get("temperature") not in (None, 1.0):
        line += f"; logits over T {ours['temperature']:.3f}"
    line += ")"
    if base:
        line += (f"  nanoGPT {base['bpb']:.4f} ({base['seconds']:.0f} s, {base['iterations']} it)  "
                 f"ratio {ours['bpb'] / base['bpb']:.3f}")
    measured = f"; measured {sizing.describe_measured(ours['measured'])}" if ours["measured"] else ""
    return line + f"  [{trained_as(ours)}; dropout {ours['dropout']:g}{measured}]"


def trained_as(ours: dict) -> str:
    """The sizing's line where the plan chose the shape; where the run set it (model.size manual, no sizing line),
    the shape and the sequences a step it trained."""
    if ours["sizing"]:
        return ours["sizing"]
    return f"set: {sizing.Shape(**ours['shape']).describe()}, batch {ours['batch_size']}"


def summary(rows: list[dict]) -> None:
    print("\ncorpus | budget | variant | ours bits/byte (mean ± sd of its runs) | nanoGPT same seconds | ratio")
    keys = dict.fromkeys((r["corpus"], r["budget"], r["variant"]) for r in rows)
    for corpus, budget, variant in keys:
        same = [r for r in rows if (r["corpus"], r["budget"], r["variant"]) == (corpus, budget, variant)]
        scores = [r["ours"]["bpb"] for r in same]
        spread = f" ± {statistics.stdev(scores):.4f}" if len(scores) > 1 else ""
        base = same[0]["baseline"]
        tail = f" | {base['bpb']:.4f} | {statistics.mean(scores) / base['bpb']:.3f}" if base else " | | "
        print(f"{corpus} | {budget} | {variant} | {statistics.mean(scores):.4f}{spread}{tail}")
    paired = [line for corpus, budget, variant in keys if variant != "defaults"
              for line in [paired_difference(rows, corpus, budget, variant)] if line]
    if paired:
        print("\ncorpus | budget | variant | minus defaults, paired by seed: mean ± standard error (seeds)")
        print("\n".join(paired))


def paired_difference(rows: list[dict], corpus: str, budget: str, variant: str) -> str | None:
    """A variant's score minus the defaults' of the same seed, over the seeds both ran (repeats averaged): at equal
    steps a seed's run repeats to the last digit, so its spread between seeds is the noise an idea must clear."""
    def by_seed(name: str) -> dict:
        same = [r for r in rows if (r["corpus"], r["budget"], r["variant"]) == (corpus, budget, name)]
        seeds = dict.fromkeys(r.get("seed") for r in same)
        return {seed: statistics.mean(r["ours"]["bpb"] for r in same if r.get("seed") == seed) for seed in seeds}
    difference = paired(by_seed(variant), by_seed("defaults"))
    return difference and f"{corpus} | {budget} | {variant} | {difference}"


def paired(scores: dict, defaults: dict) -> str | None:
    """Scores by seed minus the defaults' of the same seed, over the seeds both have: `mean ± standard error
    (seeds)`, or None for fewer than two."""
    differences = [scores[seed] - defaults[seed] for seed in scores if seed is not None and seed in defaults]
    if len(differences) < 2:
        return None
    error = statistics.stdev(differences) / math.sqrt(len(differences))
    return f"{statistics.mean(differences):+.4f} ± {error:.4f} ({len(differences)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", dest="corpora", action="append", help="a text file, or 'embedded' (repeatable)")
    parser.add_argument("--budget", dest="budgets", action="append",
                        help="2min, 30s, ...; or 1000steps: train.max_steps with no budget (the shape keys must be "
                        "set, and tokenizer.vocab_size unless a time budget is given too: equal steps, to compare ideas without "
                        "the time probe's spread; with --skip-baseline)")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--variant", dest="variants", action="append", default=[])
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument("--match", help="the baseline's seconds for every budget (time to its quality)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seeds", type=lambda v: [int(s) for s in v.split(",")],
                        help="train.seed values (e.g. 1337,1,2): each variant runs once per seed, and the summary "
                        "adds each variant's difference from the defaults paired by seed")
    parser.add_argument("--grid", action="store_true", help="optimizer × schedule at each budget")
    parser.add_argument("--workdir", type=Path, help="keep prepared copies here and reuse those that still match")
    parser.add_argument("--prepare-only", action="store_true", help="prepare the copies in --workdir, train nothing")

    args = parser.parse_args()
    if args.prepare_only and not args.workdir:
        parser.error("--prepare-only keeps its copies in --workdir: name one")
    if args.seeds and any("train.seed=" in o for o in args.overrides + args.variants):
        parser.error("--seeds sets train.seed for every run: leave it out of --set and --variant")
    args.corpora, args.budgets = args.corpora or [str(SHAKESPEARE)], args.budgets or ["2min"]
    print(f"params: {' '.join(args.overrides) or '(the shipped defaults)'}; torch threads {torch.get_num_threads()}",
          flush=True)
    with contextlib.ExitStack() as stack:
        workdir = args.workdir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ultrathink-quality-")))
        rows = [row for corpus in args.corpora for row in run_corpus(corpus, args, workdir.resolve())]
    summary(rows)


if __name__ == "__main__":
    main()
