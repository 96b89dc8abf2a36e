"""Quality for a budget: the pipeline with nothing but a budget set (train.budget, model.size auto, tokenizer
vocab auto) against nanoGPT's quick CPU config (a char-level GPT, 0.8M params, 2000 iterations), both scored on
the same held-out text in bits per byte.

The corpus's first 90% (by characters) is the pipeline's data source; the last 10% is never trained on and is scored
as raw text: `ultrathink eval` for ours, every character for the char-level baseline. The pipeline runs as users
run it (`python -m tasks.<stage>` in a copy of this project, so validate, the tokenizer, prepare and train are the
real stages); `--set` adds params (e.g. --set train.optimizer=muon).

    .venv/bin/python benchmarks/budget_quality.py [--corpus ../shared/data/tinyshakespeare.txt] [--budget 2min]
        [--set key=value ...] [--skip-baseline]
"""

from __future__ import annotations

import argparse
import json
import math
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

SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"
STAGES = ("validate", "tokenizer", "prepare", "train")


def pipeline(project: Path, corpus: str, budget: str, overrides: list[str]) -> dict:
    (project / "data" / "raw").mkdir(parents=True, exist_ok=True)
    (project / "data" / "raw" / "corpus.txt").write_text(corpus, encoding="utf-8")
    set_params(project, {
        "data": {"source": "data/raw/corpus.txt", "max_samples": None},
        "validate": {"min_rows": 100},
        "tokenizer": {"vocab_size": "auto"},
        "model": {"size": "auto", **{k: None for k in ("d_model", "n_layers", "n_heads", "n_kv_heads", "seq_len")}},
        "train": {"budget": budget, "batch_size": None, "max_steps": 300, "warmup_steps": 30, "eval_every": 100,
                  "eval_batches": 10, "checkpoint_every": 100, "log_every": 50, "lr": 0.002},
    })
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--corpus", type=Path, default=SHAKESPEARE)
    parser.add_argument("--budget", default="2min")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--skip-baseline", action="store_true")
    args = parser.parse_args()
    text = args.corpus.read_text(encoding="utf-8")
    cut = int(len(text) * 0.9)
    with tempfile.TemporaryDirectory(prefix="ultrathink-quality-") as tmp:
        project = make_project(Path(tmp))
        held_out = Path(tmp) / "held_out.txt"
        held_out.write_text(text[cut:], encoding="utf-8")
        ran = pipeline(project, text[:cut], args.budget, args.overrides)
        ours = score(project, held_out)
    s = ran["summary"]
    print(f"corpus {args.corpus.name} ({len(text.encode()):,} bytes; held out: the last 10%), budget {args.budget}, "
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
