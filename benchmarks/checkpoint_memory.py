"""Rank 0's host memory while an FSDP run checkpoints: the sharded checkpoint the Trainer writes (each rank its own
shards of the optimizer state, the weights joined from the ranks' files: ultrathink/train/sharded.py) against the
full-gather path it replaced (model and optimizer state gathered on rank 0 with full_state_dict + cpu_offload, then
written). A ~50M-parameter UltraThink on 2 gloo ranks, one training step first so the optimizer state exists.

Peak RSS is the kernel's high-water mark (VmHWM), reset just before the save (/proc/self/clear_refs) and after the
heap's free pages are returned to the system (malloc_trim: the training step's freed activations would otherwise count
as held), so it is the most memory rank 0 held while saving; each path runs in fresh processes so neither inherits the other's arenas.

    .venv/bin/python benchmarks/checkpoint_memory.py [--d-model 576] [--layers 12]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# This checkout's package, not an editable install of another clone (train_throughput.py says why).
sys.path.insert(0, str(ROOT))


def high_water_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def rank(mode: str, d_model: int, layers: int, workdir: Path) -> None:
    import numpy as np
    import torch

    from ultrathink.config import ModelConfig, TrainConfig
    from ultrathink.model import UltraThink
    from ultrathink.train.checkpoint import CheckpointManager, Fingerprint
    from ultrathink.train.distributed import setup
    from ultrathink.train.engine import build_engine
    from ultrathink.train.loader import TokenWindows
    from ultrathink.train.trainer import Trainer, ready_model

    torch.set_num_threads(1)
    dist = setup("fsdp")
    cfg = ModelConfig(d_model=d_model, n_layers=layers, n_heads=d_model // 64, n_kv_heads=d_model // 64, seq_len=64,
                      dropout=0.0)
    settings = TrainConfig(batch_size=2, max_steps=10, warmup_steps=1, precision="fp32", attention="torch",
                           weight_decay=0.1)
    torch.manual_seed(0)
    model = UltraThink(cfg, 8192)
    tokens = np.random.default_rng(0).integers(0, 8192, 20_000).astype(np.uint16)
    engine = build_engine(ready_model(model, settings, None, dist), settings, dist)
    trainer = Trainer(engine, TokenWindows(tokens, cfg.seq_len, 2, seed=0, rank=dist.rank, world_size=2),
                      tokens[:2_000], settings, CheckpointManager(workdir, Fingerprint(mode, "b", "b"), 1, 1), dist=dist)
    trainer.train_step()
    dist.barrier()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # the heap's free pages back to the system: RSS is what is live
    before = rss_mib()
    Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark to the current RSS
    if mode == "sharded":
        trainer.save_checkpoint()
    else:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)

        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = get_model_state_dict(engine.model, options=full)
        optimizers = [get_optimizer_state_dict(engine.model, opt, options=full) for opt in engine.optimizers]
        if dist.is_main:
            engine.model.save_pretrained(workdir / "gathered", weights)
            torch.save(optimizers, workdir / "gathered" / "optimizer.pt")
        dist.barrier()
    if dist.is_main:
        print(json.dumps({"mode": mode, "params": model.num_params(), "rss_before_mib": round(before, 1),
                          "peak_mib": round(high_water_mib(), 1)}), flush=True)
    dist.close()


def launch(mode: str, args) -> dict:
    with tempfile.TemporaryDirectory(prefix="ckpt-mem-") as tmp:
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                              "--master_addr=127.0.0.1", f"--master_port={29800 + (mode == 'gather')}", __file__,
                              "--rank-mode", mode, "--d-model", str(args.d_model), "--layers", str(args.layers),
                              "--workdir", tmp], cwd=ROOT, capture_output=True, text=True,
                             env=dict(os.environ, OMP_NUM_THREADS="1"))
    if out.returncode:
        raise SystemExit(out.stdout[-2000:] + out.stderr[-4000:])
    return json.loads(next(line for line in out.stdout.splitlines() if line.startswith("{")))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--d-model", type=int, default=576)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--rank-mode", choices=["sharded", "gather"])
    parser.add_argument("--workdir", type=Path)
    args = parser.parse_args()
    if args.rank_mode:
        rank(args.rank_mode, args.d_model, args.layers, args.workdir)
        return
    sharded, gather = launch("sharded", args), launch("gather", args)
    print(f"{sharded['params'] / 1e6:.1f}M parameters, FSDP on 2 gloo ranks, rank 0 while checkpointing:")
    for r in (sharded, gather):
        print(f"  {r['mode']:8s} RSS before {r['rss_before_mib']:8.1f} MiB  peak {r['peak_mib']:8.1f} MiB  "
              f"growth {r['peak_mib'] - r['rss_before_mib']:8.1f} MiB")
    print(f"peak ratio sharded / full gather: {sharded['peak_mib'] / gather['peak_mib']:.2f} (goal <= 0.6); growth "
          f"ratio {(sharded['peak_mib'] - sharded['rss_before_mib']) / (gather['peak_mib'] - gather['rss_before_mib']):.2f}")


if __name__ == "__main__":
    main()
