"""Training throughput: UltraThink vs Hugging Face LlamaForCausalLM with identical shapes, in one process,
interleaved repetitions, per precision. Prints tokens/s, MFU (against the measured matmul peak) and the ratios.

UltraThink runs what its trainer runs: its optimizer (fused AdamW with weight-decay groups), eager and with
`train.compile` (torch.compile, which fuses the norm, rotary, SiLU and cast passes between the matmuls). The HF
reference runs as a user would run it: eager, torch's default AdamW.

    python benchmarks/train_throughput.py [--precisions fp32 bf16] [--reps 3] [--steps 3]

bf16 is skipped unless asked for: on CPUs without native bf16 (AVX2-only) it runs ~40-100x slower than fp32.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import ultrathink  # noqa: F401
from ultrathink.config import ModelConfig, TrainConfig
from ultrathink.model import UltraThink
from ultrathink.train.precision import peak_flops
from ultrathink.train.engine import autocast
from ultrathink.train.optim import build_optimizers

SHAPE = dict(d_model=384, n_layers=6, n_heads=6, n_kv_heads=6, seq_len=256)
VOCAB, BATCH = 4096, 8


def models() -> dict[str, torch.nn.Module]:
    cfg = ModelConfig(**SHAPE, dropout=0.0)
    hf = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=cfg.d_model, intermediate_size=cfg.hidden, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, max_position_embeddings=cfg.seq_len,
        tie_word_embeddings=True, attn_implementation="sdpa"))
    return {"ultrathink": UltraThink(cfg, VOCAB), "ultrathink+compile": UltraThink(cfg, VOCAB), "hf_llama": hf}


def step_fn(name: str, model: torch.nn.Module, precision: str):
    x = torch.randint(0, VOCAB, (BATCH, SHAPE["seq_len"]))
    if name == "hf_llama":
        opts = [torch.optim.AdamW(model.parameters(), lr=1e-4)]
        forward = lambda: model(input_ids=x, labels=x).loss  # noqa: E731
    else:
        opts = build_optimizers(model, TrainConfig(lr=1e-4))
        module = torch.compile(model) if name.endswith("+compile") else model
        forward = lambda: module(x, x)[1]  # noqa: E731

    def step() -> None:
        with autocast(precision):
            loss = forward()
        loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--precisions", nargs="+", default=["fp32"], choices=["fp32", "bf16"])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    built = models()
    flops_per_token = built["ultrathink"].flops_per_token()
    tokens = BATCH * SHAPE["seq_len"] * args.steps
    print(f"shape {SHAPE} batch {BATCH}; {built['ultrathink'].num_params() / 1e6:.1f}M params; "
          f"{torch.get_num_threads()} threads")
    for precision in args.precisions:
        peak = peak_flops(precision)
        steps = {n: step_fn(n, m, precision) for n, m in built.items()}
        for step in steps.values():
            step()  # warm-up (and, for the compiled model, its compilation)
        best = {n: float("inf") for n in steps}
        for _ in range(args.reps):  # interleaved, so drift in the machine's speed hits both alike
            for name, step in steps.items():
                started = time.perf_counter()
                for _ in range(args.steps):
                    step()
                best[name] = min(best[name], time.perf_counter() - started)
        rate = {n: tokens / t for n, t in best.items()}
        print(f"\n{precision}: measured matmul peak {peak / 1e9:.0f} GFLOP/s")
        for name, tps in rate.items():
            print(f"  {name:<18} {tps:8,.0f} tok/s   MFU {flops_per_token * tps / peak:6.1%}")
        for name in ("ultrathink", "ultrathink+compile"):
            print(f"  ratio {name} / hf_llama: {rate[name] / rate['hf_llama']:.2f}x")


if __name__ == "__main__":
    main()
