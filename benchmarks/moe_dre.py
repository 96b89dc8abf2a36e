"""MoE and DRE against dense baselines, measured side by side in one process (not a test: prints figures).

1. MoE, 8 experts top-2 (every block), vs a dense model with the same *active* parameters (dense SwiGLU width =
   2 × expert width): training step time ratio (goal ≤ 1.3×).
2. DRE at capacity 0.5 on half the blocks vs the same model dense: training tokens/s ratio once routing is on
   (goal ≥ 1.25×), and validation loss of both after the same number of steps on the embedded corpus.

Steps of the compared models alternate, so load from other processes hits both alike. fp32 on CPU.

    .venv/bin/python benchmarks/moe_dre.py [--steps 150] [--threads N]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from ultrathink.config import DataConfig, ModelConfig, TokenizerConfig
from ultrathink.data.sources import load_corpus
from ultrathink.model import UltraThink
from ultrathink.tokenizer import load_tokenizer, train_tokenizer
from ultrathink.train.loader import TokenWindows, eval_batches

BASE = dict(d_model=192, n_layers=4, n_heads=4, n_kv_heads=2, seq_len=128, dropout=0.0)
BATCH = 16


def corpus_tokens(vocab_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """The embedded corpus, tokenized with a freshly trained BPE, EOS after each document; the last 10% of the
    documents are validation."""
    texts = load_corpus(DataConfig())["text"].tolist()
    with tempfile.TemporaryDirectory() as tmp:
        train_tokenizer(texts, TokenizerConfig(vocab_size=vocab_size), Path(tmp))
        tokenizer = load_tokenizer(tmp)
    cut = int(len(texts) * 0.9)
    ids = [tokenizer(t, add_special_tokens=False).input_ids + [tokenizer.eos_token_id] for t in texts]
    split = lambda docs: np.fromiter((i for doc in docs for i in doc), dtype=np.int64)  # noqa: E731
    return split(ids[:cut]), split(ids[cut:]), len(tokenizer)


class Run:
    """One model, its optimizer and its own data stream (same seed for every Run, so the same batches)."""

    def __init__(self, cfg: ModelConfig, vocab: int, train: np.ndarray, seed: int = 0):
        torch.manual_seed(seed)
        self.model = UltraThink(cfg, vocab).train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.1)
        # Linear warmup over 30 steps, as train.warmup_steps does: full lr at once collapses a fresh MoE router.
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: min(1.0, (step + 1) / 30))
        self.loader = TokenWindows(train, cfg.seq_len, BATCH, seed)
        self.seconds: list[float] = []

    def step(self) -> float:
        x, y = next(self.loader)
        start = time.perf_counter()
        _, loss = self.model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.schedule.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.model.after_optimizer_step()
        self.seconds.append(time.perf_counter() - start)
        return loss.item()

    def median_step(self, skip: int) -> float:
        return float(np.median(self.seconds[skip:]))

    @torch.no_grad()
    def val_loss(self, val: np.ndarray, batches: int = 20) -> float:
        self.model.eval()
        losses = [self.model(x, y)[1].item() for x, y in eval_batches(val, self.model.cfg.seq_len, BATCH, batches)]
        self.model.train()
        return float(np.mean(losses))


def alternate(runs: list[Run], steps: int) -> None:
    for _ in range(steps):
        for run in runs:
            run.step()


def moe_vs_dense(train: np.ndarray, vocab: int, steps: int) -> None:
    expert_hidden = 256
    moe_cfg = ModelConfig(**BASE, moe=dict(enabled=True, every=1, top_k=2, expert_hidden=expert_hidden,
                                           groups=dict(knowledge=3, skill=3, meta=1, safety=1)))
    dropless_cfg = moe_cfg.model_copy(update={"moe": moe_cfg.moe.model_copy(update={"capacity_factor": None})})
    moe, dropless, dense = (Run(c, vocab, train) for c in (moe_cfg, dropless_cfg, ModelConfig(**BASE,
                                                                                           ffn_hidden=2 * expert_hidden)))
    alternate([moe, dropless, dense], steps)
    print(f"MoE 8 experts top-2 in every block | active params {moe.model.active_params():,} "
          f"(total {moe.model.num_params():,}) vs dense {dense.model.num_params():,}, {steps} steps")
    base = dense.median_step(5)
    for name, run in (("capacity 1.25", moe), ("dropless", dropless)):
        health = run.model.health_metrics()
        print(f"  {name}: step {run.median_step(5) * 1e3:.0f} ms vs dense {base * 1e3:.0f} ms → "
              f"{run.median_step(5) / base:.2f}× (goal ≤ 1.3×); last step {run.model.health_line(health)}, "
              f"dropped {health['moe_dropped_frac']:.1%}")


def dre_vs_dense(train: np.ndarray, val: np.ndarray, vocab: int, steps: int, warmup: int) -> None:
    dre_cfg = ModelConfig(**BASE, dre=dict(enabled=True, every=2, path="standard", warmup_steps=warmup))
    dre, dense = Run(dre_cfg, vocab, train), Run(ModelConfig(**BASE), vocab, train)
    alternate([dre, dense], steps)
    routed = slice(warmup + 3, None)  # steps with routing on (a few after warmup, once thresholds settle)
    speed = np.median(dense.seconds[routed]) / np.median(dre.seconds[routed])
    overall = sum(dense.seconds) / sum(dre.seconds)
    health = dre.model.health_metrics()
    print(f"DRE standard path (capacity 0.5) on blocks 2 and 4 of 4, warmup {warmup} steps, {steps} steps")
    print(f"  tokens/s once routing is on: DRE {BATCH * 128 / np.median(dre.seconds[routed]):,.0f}, dense "
          f"{BATCH * 128 / np.median(dense.seconds[routed]):,.0f} → {speed:.2f}× (goal ≥ 1.25×); "
          f"whole run incl. warmup {overall:.2f}×")
    print(f"  last step: {dre.model.health_line(health)}, estimated FLOPs/token vs dense "
          f"{health['dre_flops_ratio']:.2f}")
    dre_loss, dense_loss = dre.val_loss(val), dense.val_loss(val)
    dre.model(torch.from_numpy(val[: 16 * 129].reshape(16, 129)[:, :-1]))  # eval-mode routing share
    print(f"  val loss after {steps} steps: DRE {dre_loss:.4f}, dense {dense_loss:.4f} → cost "
          f"{dre_loss - dense_loss:+.4f} nats ({dre_loss / dense_loss - 1:+.1%}); "
          f"eval-mode kept {dre.model.health_metrics()['dre_kept']:.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150, help="DRE comparison: training steps per model")
    parser.add_argument("--moe-steps", type=int, default=15, help="MoE timing: training steps per model")
    parser.add_argument("--warmup", type=int, default=30, help="DRE warmup steps at full capacity")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    train, val, vocab = corpus_tokens(vocab_size=4096)
    print(f"corpus: {len(train):,} train / {len(val):,} val tokens, vocab {vocab}, {torch.get_num_threads()} threads")
    moe_vs_dense(train, vocab, args.moe_steps)
    dre_vs_dense(train, val, vocab, args.steps, args.warmup)
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
