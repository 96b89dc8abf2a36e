"""MoE and DRE against dense baselines, trained by the real Trainer (engine, precision, routing updates), side by
side in one process. Not a test: it prints figures.

1. MoE, 8 experts top-2 in every block, vs a dense model with the same *active* parameters (dense SwiGLU width =
   2 × expert width): training step time ratio (goal ≤ 1.3×).
2. DRE at capacity 0.5 (path standard) vs the same model dense, on a block-dominated shape (d_model 512, 8 layers,
   vocab 4096): FLOPs per token ratio, training tokens/s ratio once routing is on (goal ≥ 1.25×), and the quality
   cost — validation loss at equal steps, and at equal wall time (a second DRE run given the steps the dense run's
   time buys at the measured speed).

Trainers take steps in turn (`Trainer.train_step`, what `fit` calls), so load from other processes hits both alike.
Precision is `auto` (what users get): bf16 on CPUs that run it faster.

    .venv/bin/python benchmarks/moe_dre.py [--steps 120] [--every 2] [--threads N] [--attention]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

# This checkout's package, not an editable install of another clone (train_throughput.py says why).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ultrathink.config import DataConfig, ModelConfig, TokenizerConfig, TrainConfig  # noqa: E402
from ultrathink.data.sources import load_corpus  # noqa: E402
from ultrathink.model import UltraThink  # noqa: E402
from ultrathink.model.kernels import choose_attention  # noqa: E402
from ultrathink.tokenizer import load_tokenizer, train_tokenizer  # noqa: E402
from ultrathink.train.checkpoint import CheckpointManager, Fingerprint  # noqa: E402
from ultrathink.train.loader import TokenWindows  # noqa: E402
from ultrathink.train.precision import resolve_precision  # noqa: E402
from ultrathink.train.distributed import Distributed  # noqa: E402
from ultrathink.train.engine import build_engine  # noqa: E402
from ultrathink.train.trainer import Trainer, ready_model  # noqa: E402

SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"
MOE_SHAPE = dict(d_model=192, n_layers=4, n_heads=4, n_kv_heads=2, seq_len=128, dropout=0.0)
DRE_SHAPE = dict(d_model=512, n_layers=8, n_heads=8, n_kv_heads=4, seq_len=128, dropout=0.0)
BATCH = 16


def corpus_tokens(vocab_size: int) -> tuple[np.ndarray, np.ndarray, int, str]:
    """Tiny Shakespeare when it is at hand (else the embedded corpus), tokenized with a freshly trained BPE; the
    last 10% is validation, never trained on."""
    if SHAKESPEARE.is_file():
        text = SHAKESPEARE.read_text()
        texts, source = [p for p in text.split("\n\n") if p.strip()], "tiny shakespeare"
    else:
        texts, source = load_corpus(DataConfig())["text"].tolist(), "embedded corpus"
    with tempfile.TemporaryDirectory() as tmp:
        train_tokenizer(texts, TokenizerConfig(vocab_size=vocab_size), Path(tmp))
        tokenizer = load_tokenizer(tmp)
    eos = tokenizer.eos_token_id
    ids = [i for enc in tokenizer.backend_tokenizer.encode_batch_fast(texts, add_special_tokens=False)
           for i in (*enc.ids, eos)]
    cut = int(len(ids) * 0.9)
    return np.array(ids[:cut], dtype=np.uint16), np.array(ids[cut:], dtype=np.uint16), len(tokenizer), source


class Run:
    """One model and the real Trainer around it, stepping on demand; each step's seconds and routing figures."""

    def __init__(self, name: str, cfg: ModelConfig, vocab: int, train: np.ndarray, val: np.ndarray, steps: int,
                 workdir: Path):
        self.name = name
        settings = TrainConfig(max_steps=steps, batch_size=BATCH, lr=2e-3, warmup_steps=min(30, steps // 4),
                               eval_every=10**9, checkpoint_every=10**9, eval_batches=20, precision="auto",
                               weight_decay=0.1)
        torch.manual_seed(0)
        model = UltraThink(cfg, vocab)
        checkpoints = CheckpointManager(workdir / name, Fingerprint(name, "bench", "bench"), 1, 1)
        self.trainer = Trainer(build_engine(ready_model(model, settings, None, Distributed()), settings, Distributed()), TokenWindows(train, cfg.seq_len, BATCH, seed=0), val, settings, checkpoints)
        self.seconds: list[float] = []
        self.figures: list[dict[str, float]] = []

    def step(self) -> None:
        started = time.perf_counter()
        outcome = self.trainer.train_step()
        self.seconds.append(time.perf_counter() - started)
        assert outcome is not None, f"{self.name}: a non-finite step"
        self.figures.append(outcome[2])

    def tokens_per_second(self, steps: slice) -> float:
        return BATCH * self.trainer.model.cfg.seq_len / float(np.median(self.seconds[steps]))

    def val_loss(self) -> float:
        return self.trainer.validate()


def alternate(runs: list[Run], steps: int) -> None:
    for _ in range(steps):
        for run in runs:
            run.step()


def moe_vs_dense(train, val, vocab, steps, workdir) -> None:
    expert_hidden = 256
    moe_cfg = ModelConfig(**MOE_SHAPE, moe=dict(enabled=True, every=1, top_k=2, expert_hidden=expert_hidden))
    dropless_cfg = moe_cfg.model_copy(update={"moe": moe_cfg.moe.model_copy(update={"capacity_factor": None})})
    dense_cfg = ModelConfig(**MOE_SHAPE, ffn_hidden=2 * expert_hidden)
    runs = [Run(n, c, vocab, train, val, steps, workdir)
            for n, c in (("moe", moe_cfg), ("moe-dropless", dropless_cfg), ("moe-dense", dense_cfg))]
    alternate(runs, steps)
    moe, dropless, dense = runs
    print(f"MoE 8 experts top-2 in every block | active params {moe.trainer.model.active_params():,} "
          f"(total {moe.trainer.model.num_params():,}) vs dense {dense.trainer.model.num_params():,}, {steps} steps")
    base = float(np.median(dense.seconds[3:]))
    for name, run in (("capacity 1.25", moe), ("dropless", dropless)):
        step = float(np.median(run.seconds[3:]))
        last = run.figures[-1]
        print(f"  {name}: step {step * 1e3:.0f} ms vs dense {base * 1e3:.0f} ms → {step / base:.2f}× (goal ≤ 1.3×); "
              f"last step {run.trainer.model.routing_line(last)}, dropped {last['moe_dropped_frac']:.1%}")


def dre_vs_dense(train, val, vocab, steps, every, warmup, workdir) -> None:
    dre_cfg = ModelConfig(**DRE_SHAPE, dre=dict(enabled=True, every=every, path="standard", warmup_steps=warmup))
    dense_cfg = ModelConfig(**DRE_SHAPE)
    dre, dense = (Run(n, c, vocab, train, val, steps, workdir) for n, c in (("dre", dre_cfg), ("dense", dense_cfg)))
    alternate([dre, dense], steps)
    routed = slice(warmup + 3, None)  # steps with routing on (a few after warmup, once thresholds settle)
    speed = dre.tokens_per_second(routed) / dense.tokens_per_second(routed)
    flops = float(np.mean([f["dre_flops_ratio"] for f in dre.figures[routed]]))
    kept = float(np.mean([f["dre_kept"] for f in dre.figures[routed]]))
    blocks = [i + 1 for i in range(DRE_SHAPE["n_layers"]) if dre_cfg.dre.applies_to(i)]
    print(f"DRE standard path (capacity 0.5) on blocks {blocks} of {DRE_SHAPE['n_layers']} | d_model "
          f"{DRE_SHAPE['d_model']}, vocab {vocab}, {dre.trainer.model.num_params() / 1e6:.1f}M params, "
          f"precision {resolve_precision(dre.trainer.cfg.precision)}, warmup {warmup}, {steps} steps")
    slots = float(np.mean([np.mean([v for k, v in f.items() if k.endswith("attention_slots")])
                           for f in dre.figures[routed]]))
    print(f"  FLOPs per token vs dense (routed steps): {flops:.3f}; kept {kept:.1%}, attention slots (kept and "
          f"padding) {slots:.1%}")
    print(f"  tokens/s once routing is on: DRE {dre.tokens_per_second(routed):,.0f}, dense "
          f"{dense.tokens_per_second(routed):,.0f} → {speed:.2f}× (goal ≥ 1.25×); whole run incl. warmup "
          f"{sum(dense.seconds) / sum(dre.seconds):.2f}×")
    dre_loss, dense_loss = dre.val_loss(), dense.val_loss()
    print(f"  equal steps ({steps}): val loss DRE {dre_loss:.4f}, dense {dense_loss:.4f} → cost "
          f"{dre_loss - dense_loss:+.4f} nats ({dre_loss / dense_loss - 1:+.1%})")
    # Equal wall time: the steps the dense run's training time buys the DRE model, in a run scheduled for them.
    budget = sum(dense.seconds)
    more = round(steps * sum(dense.seconds) / sum(dre.seconds))
    longer = Run("dre-equal-time", dre_cfg, vocab, train, val, more, workdir)
    for _ in range(more):
        longer.step()
    longer_loss = longer.val_loss()
    print(f"  equal wall time ({budget:.0f} s of dense training buys {more} DRE steps, which took "
          f"{sum(longer.seconds):.0f} s): val loss DRE {longer_loss:.4f}, dense {dense_loss:.4f} → "
          f"{longer_loss - dense_loss:+.4f} nats ({longer_loss / dense_loss - 1:+.1%})")


def attention_choice() -> None:
    """What train.attention auto measures (ultrathink/model/kernels.py) at the DRE shape's attention (16 rows, 8
    query and 4 key/value heads of 64), bf16 autocast: forward+backward ms of each kernel, and its choice."""
    for length in (256, 128, 64):
        kernel, timings = choose_attention("auto", BATCH, 8, 4, length, 64, 0.0, "cpu", torch.bfloat16)
        print(f"attention fwd+bwd, {length} tokens: " + ", ".join(f"{k} {v:.1f} ms" for k, v in timings.items())
              + f" → {kernel.backend}{' in fp32' if kernel.fp32 else ''}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120, help="DRE comparison: training steps per model")
    parser.add_argument("--every", type=int, default=2, help="DRE: route every n-th block")
    parser.add_argument("--warmup", type=int, default=20, help="DRE warmup steps at full capacity")
    parser.add_argument("--moe-steps", type=int, default=15, help="MoE timing: training steps per model")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--skip-moe", action="store_true")
    parser.add_argument("--attention", action="store_true", help="only time the attention kernels (train.attention)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.attention:
        attention_choice()
        return
    started = time.perf_counter()
    train, val, vocab, source = corpus_tokens(vocab_size=4096)
    print(f"corpus: {source}, {len(train):,} train / {len(val):,} val tokens, vocab {vocab}, "
          f"{torch.get_num_threads()} threads")
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_moe:
            moe_vs_dense(train, val, vocab, args.moe_steps, Path(tmp))
        dre_vs_dense(train, val, vocab, args.steps, args.every, args.warmup, Path(tmp))
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
