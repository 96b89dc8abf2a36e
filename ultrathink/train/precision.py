"""Which precision to train in. bf16 is the fast path only on hardware that has it: on a CPU with native bf16
(AVX512-BF16/AMX) it is ~3× faster than fp32, on an AVX2-only CPU it is ~40× *slower*. So `auto` measures."""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import time

import torch

from ultrathink.device import DeviceLike, device_type, is_cuda, synchronize

log = logging.getLogger(__name__)


def matmul_gflops(dtype: torch.dtype, size: int = 512, repeats: int = 3, device: DeviceLike = "cpu") -> float:
    """Measured dense matmul throughput on `device` (on a CPU, for the threads torch uses): the fastest of `repeats`
    timed matmuls, since a peak is what the machine can do, and a shared machine's stalls only ever slow a run down."""
    # A private generator: drawing from the global one would shift dropout masks and break exact resume.
    generator = torch.Generator(device=device).manual_seed(0)
    a, b = (torch.randn(size, size, generator=generator, device=device).to(dtype) for _ in range(2))
    torch.mm(a, b)  # warm-up: first call pays for kernel selection
    synchronize(device)  # time from an idle device to a finished one
    fastest = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        torch.mm(a, b)
        synchronize(device)
        fastest = min(fastest, time.perf_counter() - started)
    return 2 * size**3 / fastest / 1e9


# A CPU's peak is the fastest of square matmuls of growing sizes: small ones reach a fraction of it (512²: half on a
# bf16 Xeon). The sizes stop growing before one whose matmul would take longer than PEAK_MATMUL_SECONDS (at the rate
# the last size measured): an AVX2-only CPU runs bf16 at ~1 GFLOP/s a thread, so a 2048² bf16 matmul takes ~20 s
# there, and timing six of them made a fresh plan take over five minutes.
CPU_PEAK_SIZES = (512, 1024, 2048)
PEAK_MATMUL_SECONDS = 0.5


def cpu_peak_gflops(dtype: torch.dtype, repeats: int = 5, device: DeviceLike = "cpu") -> float:
    """A CPU's matmul peak in `dtype` (GFLOP/s, for the threads torch uses): the fastest of CPU_PEAK_SIZES, up to the
    first size whose matmul would take longer than PEAK_MATMUL_SECONDS."""
    best = 0.0
    for size in CPU_PEAK_SIZES:
        gflops = matmul_gflops(dtype, size=size, repeats=repeats, device=device)
        best = max(best, gflops)
        if 2 * (2 * size) ** 3 / (gflops * 1e9) > PEAK_MATMUL_SECONDS:  # the next size, doubled, at this rate
            break
    return best


@functools.lru_cache(maxsize=None)
def resolve_precision(requested: str, device: DeviceLike = "cpu") -> str:
    """'fp32', 'bf16' or 'fp16'. `auto` picks bf16 on a GPU that supports it ("cuda", "cuda:1", torch.device("cuda")
    alike), and on a CPU only where it measures faster. fp16 is for GPUs without bf16 and always comes with loss
    scaling (a gradient scaler), on a CPU too, where it runs but is seldom faster than bf16."""
    if requested != "auto":
        return requested
    if is_cuda(device):
        return "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp32"
    fp32, bf16 = matmul_gflops(torch.float32), matmul_gflops(torch.bfloat16)
    choice = "bf16" if bf16 > 1.2 * fp32 else "fp32"
    log.info("precision auto → %s (matmul: fp32 %.0f, bf16 %.0f GFLOP/s)", choice, fp32, bf16)
    return choice


# Dense peak FLOP/s (no 2:4 sparsity: datasheets print the sparse figure, twice the dense one, with a *) by precision,
# the denominator of MFU on a GPU. Keys are exactly what `torch.cuda.get_device_name()` returns, and the lookup is
# exact: a substring match would give an L40S the L4's peak. Sources: NVIDIA's datasheets and product pages (the
# Ada and Ampere GA102 whitepapers for the GeForce cards, AWS's A10G datasheet), tensor-core figures with FP32
# accumulate, as torch's matmuls run. "fp32" is the TF32 tensor-core peak where the GPU has TF32 (the trainer
# enables it), plain FP32 where it does not (T4, V100); those two have no bf16, so no "bf16" entry.
_H100_SXM = {"bf16": 989.5e12, "fp16": 989.5e12, "fp32": 494.5e12}
_H100_NVL = {"bf16": 835.5e12, "fp16": 835.5e12, "fp32": 417.5e12}
_A100 = {"bf16": 312e12, "fp16": 312e12, "fp32": 156e12}
_V100_SXM2 = {"fp16": 125e12, "fp32": 15.7e12}
_V100_PCIE = {"fp16": 112e12, "fp32": 14e12}
GPU_PEAK_FLOPS: dict[str, dict[str, float]] = {
    "NVIDIA H100 80GB HBM3": _H100_SXM,  # H100 SXM5
    "NVIDIA H100 PCIe": {"bf16": 756.5e12, "fp16": 756.5e12, "fp32": 378e12},
    "NVIDIA H100 NVL": _H100_NVL,
    "NVIDIA H200": _H100_SXM,  # H200 SXM: the H100 SXM's compute, more and faster memory
    "NVIDIA H200 NVL": _H100_NVL,
    "NVIDIA GH200 480GB": _H100_SXM,
    "NVIDIA A100-SXM4-80GB": _A100,
    "NVIDIA A100-SXM4-40GB": _A100,
    "NVIDIA A100-PCIE-40GB": _A100,
    "NVIDIA A100 80GB PCIe": _A100,
    "NVIDIA A10": {"bf16": 125e12, "fp16": 125e12, "fp32": 62.5e12},
    "NVIDIA A10G": {"bf16": 70e12, "fp16": 70e12, "fp32": 35e12},  # AWS's A10G: half the A10's tensor rate per SM
    "NVIDIA L4": {"bf16": 121e12, "fp16": 121e12, "fp32": 60e12},
    "NVIDIA L40": {"bf16": 181e12, "fp16": 181e12, "fp32": 90.5e12},
    "NVIDIA L40S": {"bf16": 362e12, "fp16": 362e12, "fp32": 183e12},
    "NVIDIA GeForce RTX 3090": {"bf16": 71e12, "fp16": 71e12, "fp32": 35.6e12},
    "NVIDIA GeForce RTX 4090": {"bf16": 165.2e12, "fp16": 165.2e12, "fp32": 82.6e12},
    "Tesla T4": {"fp16": 65e12, "fp32": 8.1e12},
    "Tesla V100-SXM2-16GB": _V100_SXM2,
    "Tesla V100-SXM2-32GB": _V100_SXM2,
    "Tesla V100-PCIE-16GB": _V100_PCIE,
    "Tesla V100-PCIE-32GB": _V100_PCIE,
}

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def table_peak(name: str, precision: str) -> float | None:
    """The datasheet peak of the GPU called exactly `name` in `precision`, or None where the table has none."""
    return GPU_PEAK_FLOPS.get(name, {}).get(precision)


@functools.lru_cache(maxsize=None)
def peak_flops(precision: str, device: DeviceLike = "cpu") -> float | None:
    """FLOP/s this device can do in `precision`, the denominator of MFU; None where it cannot be known, and then MFU
    is left out. A GPU in GPU_PEAK_FLOPS gets its datasheet peak; any other accelerator, and a CPU, a short measured
    matmul. MFU is a log figure, so this never raises: a failure is one warning (cached, so once per precision and
    device) and None."""
    try:
        precision = resolve_precision(precision, device_type(device))
        name = torch.cuda.get_device_name(device) if is_cuda(device) else None
    except Exception as error:  # whatever went wrong, it must not stop a run
        log.warning("no peak FLOP/s for %s in %s (%s): MFU is left out", device, precision, error)
        return None
    if name is not None and (peak := table_peak(name, precision)) is not None:
        return peak
    # A GPU needs big matrices to near its peak: an 8192² matmul takes ~1 ms on an H100 (bf16), ~0.15 s on a T4 (fp32).
    try:
        dtype = _DTYPES[precision]
        gflops = (cpu_peak_gflops(dtype, device=device) if name is None
                  else matmul_gflops(dtype, size=8192, repeats=10, device=device))
        peak = gflops * 1e9
    except Exception as error:  # out of memory, no kernel for the dtype, a driver error...
        missing = "" if name is None else f"GPU {name!r} has no {precision} peak in GPU_PEAK_FLOPS and "
        log.warning("%smeasuring a %s matmul peak on %s failed (%s): MFU is left out", missing, precision, device,
                    error)
        return None
    if name is not None:
        log.warning("GPU %r has no %s peak in GPU_PEAK_FLOPS: MFU uses a measured matmul peak (%.0f TFLOP/s), which "
                    "reads higher than a datasheet-based MFU; add the GPU's datasheet peak to the table", name,
                    precision, peak / 1e12)
    return peak


def use_deterministic_kernels(on: bool) -> None:
    """train.deterministic: torch raises on an op that has no deterministic kernel instead of running a
    nondeterministic one; cuBLAS needs a fixed workspace for that, set before its first call."""
    if on:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(on)


def keep_freed_host_memory() -> bool:
    """Ask glibc's allocator to keep freed memory instead of returning it to the OS each step. A CPU training step
    frees and re-allocates buffers of tens of MB (the logits and their gradient), and by default each comes back
    as fresh pages that fault in again: 8% of a step at d_model 384 here (benchmarks/train_throughput.py, run with
    and without MALLOC_TOP_PAD_ and friends). Process-wide, for the training process only; a no-op off glibc.
    Returns whether it applied."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    trim_threshold, top_pad, mmap_threshold = -1, -2, -3  # mallopt parameters (malloc.h)
    return all(libc.mallopt(option, value) == 1 for option, value in (
        (top_pad, 512 << 20), (trim_threshold, 2**31 - 1), (mmap_threshold, 32 << 20)))
