"""Which precision to train in. bf16 is the fast path only on hardware that has it: on a CPU with native bf16
(AVX512-BF16/AMX) it is ~3× faster than fp32, on an AVX2-only CPU it is ~40× *slower*. So `auto` measures."""

from __future__ import annotations

import functools
import logging
import time

import torch

log = logging.getLogger(__name__)


def matmul_gflops(dtype: torch.dtype, size: int = 512, repeats: int = 3) -> float:
    """Measured dense matmul throughput on this CPU, for the threads torch uses: the fastest of `repeats` timed
    matmuls, since a peak is what the machine can do, and a shared machine's stalls only ever slow a run down."""
    # A private generator: drawing from the global one would shift dropout masks and break exact resume.
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(size, size, generator=generator).to(dtype) for _ in range(2))
    torch.mm(a, b)  # warm-up: first call pays for kernel selection
    fastest = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        torch.mm(a, b)
        fastest = min(fastest, time.perf_counter() - started)
    return 2 * size**3 / fastest / 1e9


@functools.lru_cache(maxsize=None)
def resolve_precision(requested: str, device: str = "cpu") -> str:
    """'fp32', 'bf16' or 'fp16'. `auto` picks bf16 on a GPU that supports it, and on a CPU only where it measures
    faster. fp16 (with loss scaling) is for GPUs without bf16; on a CPU it is refused."""
    if requested == "fp16" and device != "cuda":
        raise ValueError("train.precision: fp16 needs a CUDA GPU (it relies on loss scaling there); use auto or bf16")
    if requested != "auto":
        return requested
    if device == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    fp32, bf16 = matmul_gflops(torch.float32), matmul_gflops(torch.bfloat16)
    choice = "bf16" if bf16 > 1.2 * fp32 else "fp32"
    log.info("precision auto → %s (matmul: fp32 %.0f, bf16 %.0f GFLOP/s)", choice, fp32, bf16)
    return choice


# Dense peak FLOP/s of known accelerators (no sparsity), by precision: the denominator of MFU on a GPU.
GPU_PEAK_FLOPS = {
    "H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 494e12},  # SXM; fp32 matmuls run as TF32
    "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 494e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 156e12},
    "L4": {"bf16": 121e12, "fp16": 121e12, "fp32": 60e12},
}


@functools.lru_cache(maxsize=None)
def peak_flops(precision: str, device: str = "cpu") -> float:
    """FLOP/s this device can do in `precision`: a table for GPUs, a short measured matmul on a CPU."""
    precision = resolve_precision(precision, device.split(":")[0])
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name()
        for key, peaks in GPU_PEAK_FLOPS.items():
            if key in name:
                return peaks[precision]
        raise ValueError(f"no known peak for GPU {name!r}; add it to GPU_PEAK_FLOPS")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    return matmul_gflops(dtype, size=1024, repeats=10) * 1e9
