"""What a validation step that improved costs in checkpoints: the best checkpoint the Trainer writes, then the
periodic checkpoint of the same step, written again (before) or linked to the best one (CheckpointManager.save_as,
what Trainer.fit does now). The real Trainer of a UltraThink model at each shape (train_throughput's), one training
step first so the optimizer and weight-average states exist, checkpoints on this machine's disk; the fastest of
`--reps` rounds.

    .venv/bin/python benchmarks/checkpoint_seconds.py [--shape 192x3 --shape 384x6 --shape 768x12] [--reps 3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from train_throughput import ultrathink_trainer  # noqa: E402

from ultrathink.model.kernels import AttentionKernel  # noqa: E402
from ultrathink.train.distributed import Distributed  # noqa: E402
from ultrathink.train.trainer import Trainer  # noqa: E402


def trainer_at(shape: str, directory: Path) -> Trainer:
    """train_throughput's Trainer (vocabulary 4096, seq 256, batch 8) at d_model × layers, heads of 64, fp32, with
    the weight average on, after one step."""
    d_model, n_layers = (int(x) for x in shape.split("x"))
    heads = max(1, d_model // 64)
    trainer = ultrathink_trainer(directory, Distributed(), False, "fp32", AttentionKernel(), ema_horizon=0.1,
                                 model_keys=dict(d_model=d_model, n_layers=n_layers, n_heads=heads, n_kv_heads=heads))
    trainer.train_step()
    return trainer


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", help="d_modelxlayers (repeatable; default 192x3 384x6 768x12)")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for shape in args.shape or ["192x3", "384x6", "768x12"]:
        with tempfile.TemporaryDirectory() as tmp:
            trainer = trainer_at(shape, Path(tmp))
            rounds = []
            for _ in range(args.reps):
                best = [None]
                best_seconds = timed(lambda: best.__setitem__(0, trainer.save_checkpoint(name="best")))
                written = timed(trainer.save_checkpoint)
                linked = timed(lambda: trainer.checkpoints.save_as(best[0]))
                rounds.append((best_seconds, written, linked))
            best_seconds, written, linked = (min(r[i] for r in rounds) for i in range(3))
            params = sum(p.numel() for p in trainer.model.parameters())
            print(f"{shape:>7} {params / 1e6:6.1f}M params: best {best_seconds:6.3f} s; the step's periodic checkpoint "
                  f"written again {written:6.3f} s, linked {linked:6.3f} s; the step's checkpoints "
                  f"{best_seconds + written:6.3f} → {best_seconds + linked:6.3f} s "
                  f"({(best_seconds + written) / (best_seconds + linked):.2f}x)", flush=True)


if __name__ == "__main__":
    main()
