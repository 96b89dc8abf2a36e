"""Quality for a budget: the pipeline with nothing but a budget set (train.budget, model.size auto, tokenizer
vocab auto) against nanoGPT's quick CPU config (a char-level GPT, 0.8M params, 2000 iterations), both scored on
the same held-out text in bits per byte.

The corpus's first 90% (by characters) is the pipeline's data source; the last 10% is never trained on and is scored
as raw text: `ultrathink eval` for ours, every character for the char-level baseline. The pipeline runs as users
run it (`python -m tasks.<stage>` in a copy of this project, so validate, the tokenizer, prepare and train are the
real stages); `--set` adds params (e.g. --set train.optimizer=muon).

    .venv/bin/python benchmarks/budget_quality.py [--corpus ../shared/data/tinyshakespeare.txt|embedded]
        [--budget 2min] [--set key=value ...] [--skip-baseline] [--grid]

--grid trains once per optimizer × schedule (AdamW, Muon, Lion × cosine, WSD) at the same budget and prints the
table the defaults were picked from (Lion at a tenth of the learning rate, as its authors advise).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from reference_gpt import GPT  # noqa: E402
from tests.e2e_helpers import make_project, set_params, sh  # noqa: E402

from ultrathink.text_eval import evaluate_text_file  # noqa: E402
from ultrathink.train.engine import autocast  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
STAGES = ("validate", "tokenizer", "prepare", "train")


def pipeline(project: Path, corpus: str, budget: str, overrides: list[str]) -> dict:
    (project / "data" / "raw").mkdir(parents=True, exist_ok=True)
    (project / "data" / "raw" / "corpus.txt").write_text(corpus, encoding="utf-8")
    # The shipped params.yaml (make_project wrote the tests' tiny ones), then only the source and the budget.
    shutil.copy(ROOT / "params.yaml", project / "params.yaml")
    set_params(project, {"data": {"source": "data/raw/corpus.txt"}, "tokenizer": {"vocab_size": "auto"},
                         "model": {"size": "auto"}, "train": {"budget": budget}})
    seconds = {}
    for stage in STAGES:
        started = time.perf_counter()
        done = sh([sys.executable, "-m", f"tasks.{stage}", *sum((["--set", o] for o in overrides), [])], project)
        seconds[stage] = time.perf_counter() - started
        if stage == "train":
            print("\n".join(line for line in (done.stdout + done.stderr).splitlines()
                            if line.startswith(("plan:", "train:")) or "plan:" in line)[-1500:])
    summary = json.loads((project / "artifacts" / "model" / "train_summary.json").read_text())
    return {"seconds": seconds, "summary": summary}


def score(project: Path, held_out: Path) -> dict:
    """What `ultrathink eval --model artifacts/model --text-file held_out` computes."""
    return evaluate_text_file(str(project / "artifacts" / "model"), held_out, "paragraph").to_dict()


def char_baseline(train_text: str, held_out: str, iterations: int = 2000) -> tuple[float, float]:
    """nanoGPT's README CPU run of shakespeare_char: 4 layers, 4 heads, 128 wide, block 64, batch 12, dropout 0, lr
    1e-3 cosine to 1e-4 over 2000 iterations after 100 warmup, AdamW betas (0.9, 0.99), bf16 where faster. Returns
    (bits per byte on held_out, training seconds)."""
    chars = sorted(set(train_text) | set(held_out))
    index = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([index[c] for c in train_text])
    torch.manual_seed(1337)
    model = GPT(len(chars), 128, 4, 4, 64)
    opt = model.optimizer(1e-3)
    for group in opt.param_groups:
        group["betas"] = (0.9, 0.99)
    started = time.perf_counter()
    for it in range(iterations):
        lr = 1e-3 * (it + 1) / 100 if it < 100 else 1e-4 + 0.5 * (1e-3 - 1e-4) * (
            1 + math.cos(math.pi * (it - 100) / (iterations - 100)))
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(len(data) - 65, (12,))
        x = torch.stack([data[s:s + 64] for s in starts])
        y = torch.stack([data[s + 1:s + 65] for s in starts])
        with autocast("auto"):
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - started
    ids = torch.tensor([index[c] for c in held_out])
    total = 0.0
    model.eval()
    with torch.no_grad():
        for s in range(0, len(ids) - 1, 64):
            x, y = ids[s:s + 64], ids[s + 1:s + 65]
            x = x[: len(y)]
            total += F.cross_entropy(_logits(model, x[None]), y, reduction="sum").item()
    # Every character after the first is predicted once (windows of 64 without overlap, as `ultrathink eval` does).
    return total / math.log(2) / len(held_out.encode("utf-8")), seconds


def _logits(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    x = model.wte(idx) + model.wpe(torch.arange(idx.shape[1]))
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


def trained_score(text: str, cut: int, budget: str, overrides: list[str]) -> tuple[dict, dict]:
    with tempfile.TemporaryDirectory(prefix="ultrathink-quality-") as tmp:
        project = make_project(Path(tmp))
        held_out = Path(tmp) / "held_out.txt"
        held_out.write_text(text[cut:], encoding="utf-8")
        ran = pipeline(project, text[:cut], budget, overrides)
        return ran, score(project, held_out)


def grid(text: str, cut: int, name: str, budget: str, overrides: list[str]) -> None:
    rows = []
    for optimizer, schedule in GRID:
        extra = [f"train.optimizer={optimizer}", f"train.schedule={schedule}"]
        extra += [f"train.lr={LION_LR}"] if optimizer == "lion" else []
        ran, ours = trained_score(text, cut, budget, overrides + extra)
        rows.append((optimizer, schedule, ours["bits_per_byte"], ran["summary"]["steps"], ran["summary"]["seconds"]))
        print(f"  {optimizer:6s} {schedule:7s} {ours['bits_per_byte']:.4f} bits/byte  ({rows[-1][3]} steps, "
              f"{rows[-1][4]:.0f} s)", flush=True)
    best = min(rows, key=lambda r: r[2])
    print(f"{name}, budget {budget}: best {best[0]} + {best[1]} at {best[2]:.4f} bits/byte held out")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--corpus", default=str(SHAKESPEARE), help="a text file, or 'embedded'")
    parser.add_argument("--budget", default="2min")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument("--grid", action="store_true", help="optimizer × schedule table (no baseline)")
    args = parser.parse_args()
    text = corpus_text(args.corpus)
    cut = int(len(text) * 0.9)
    name = Path(args.corpus).name
    if args.grid:
        return grid(text, cut, name, args.budget, args.overrides)
    ran, ours = trained_score(text, cut, args.budget, args.overrides)
    s = ran["summary"]
    print(f"corpus {name} ({len(text.encode()):,} bytes; held out: the last 10%), budget {args.budget}, "
          f"params {' '.join(args.overrides) or '(defaults)'}")
    print(f"  ultrathink: {ours['bits_per_byte']:.4f} bits/byte held out; train stage "
          f"{ran['seconds']['train']:.1f} s (training {s['seconds']:.1f} s, {s['steps']} steps, {s['params']:,} "
          f"params); stages " + ", ".join(f"{k} {v:.1f} s" for k, v in ran["seconds"].items()))
    if not args.skip_baseline:
        bpb, seconds = char_baseline(text[:cut], text[cut:])
        print(f"  nanoGPT char-level baseline (README CPU config, 2000 iterations): {bpb:.4f} bits/byte, "
              f"{seconds:.1f} s of training")


if __name__ == "__main__":
    main()
