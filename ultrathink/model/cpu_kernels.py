"""RMSNorm and rotary embedding on a CPU through fused kernels (csrc/cpu_kernels.cpp): one pass over each row
forward and one backward, where torch 2.13 runs several elementwise operators; matmul attention's causal softmax
forward (kernels.py), which reads only the scores a query sees; and SwiGLU's gate, silu(gate) * up.

Why: torch has no fused RMSNorm for CPUs. Its `rms_norm` there runs pow, mean, rsqrt, two products and casts, 3-7×
slower forward+backward than this kernel and than ATen's fused LayerNorm, and rotary embedding is a slice, a
negation, a concatenation, two products and a sum. A Qwen3 block has four norms and rotates queries and keys where
GPT-2's has two LayerNorms, and at the issue's shape (d384 × 6) those were most of the eager step's gap to GPT-2's
(benchmarks/README.md). The q/k norms and the rotation that follows them are one kernel. GPUs keep torch's own
kernels, and `torch.compile` torch's composite forms, which Inductor fuses by itself.

The kernel is built with the machine's C++ compiler on first use (about 20 s on two cores) for this CPU
(-march=native), and kept in the extensions cache (`$TORCH_EXTENSIONS_DIR`, default ~/.cache/torch_extensions) under
a name that hashes the source, the flags, torch, Python and the CPU's feature flags, so a changed kernel or another
machine class builds its own. `make setup` builds it ahead, so no training run pays for it. Each build runs in a
private directory and the finished library is renamed into the cache: two processes building at once, or one
killed mid-build, leave neither a lock nor a half-written library. Where it cannot be built (no compiler, another
architecture), all of them stay on torch's path, with one warning.

The norm, rotary and SwiGLU kernels each stand in for a line the model writes in torch's operators
(RMSNorm.normalized, apply_rotary, SwiGLU.gated), and only while the two compute the same: `computes_*` probe each
line once against its kernel, so an edited line runs as written on a CPU too (with one warning), as it does on a
GPU and under torch.compile. The causal softmax is not such a line: it is attention's, which every attention
kernel computes alike (SDPA's among them), and the compiled operator's backward is softmax's.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import importlib.util
import logging
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.cpp"
# -fopenmp: at::parallel_for splits the rows over torch's threads only in code built with OpenMP. Built without it
# (until 2026-12-07) each kernel ran on one thread: the eager bf16 step at d384 × 6 took 7% longer on two cores
# (benchmarks/README.md). It calls the OpenMP runtime torch has loaded (libgomp in the Linux wheels), so
# torch.set_num_threads sets its thread count too.
FLAGS = ("-O3", "-march=native", "-fopenmp")
DTYPES = (torch.float32, torch.bfloat16)
_torch_path = contextvars.ContextVar("ultrathink_torch_path", default=False)


def cache_dir() -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    return Path(root) / "ultrathink"


def cpu_features() -> str:
    """What -march=native compiles for: the CPU's model and feature flags (Linux), else what platform knows."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({line for line in lines if line.startswith(("flags", "model name", "Features"))}))
    except OSError:
        return f"{platform.machine()} {platform.processor()}"


def library_name() -> str:
    identity = "\n".join([SOURCE.read_text(), " ".join(FLAGS), torch.__version__, sys.version, cpu_features()])
    return "ultrathink_cpu_kernels_" + hashlib.sha256(identity.encode()).hexdigest()[:16]


def _import(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(name: str, target: Path) -> ModuleType:
    """Compile the kernel in a private directory and rename the library into `target` (atomic on one filesystem)."""
    from torch.utils.cpp_extension import load

    target.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with interpreter_tools_on_path(), tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as private:
        module = load(name, [str(SOURCE)], extra_cflags=list(FLAGS), extra_ldflags=["-fopenmp"],
                      build_directory=private, verbose=False)
        os.replace(Path(module.__file__), target)
    log.info("built the fused CPU kernels in %.1f s: %s", time.perf_counter() - started, target)
    return module


@contextlib.contextmanager
def interpreter_tools_on_path():
    """torch builds with ninja, which pip installs beside the interpreter (.venv/bin). A run of .venv/bin/ultrathink
    or .venv/bin/python without that directory on PATH, on a machine without a system ninja, finds it there: the
    directory goes at the end of PATH for the build, so the user's own tools still come first."""
    before = os.environ.get("PATH")
    os.environ["PATH"] = os.pathsep.join(filter(None, [before, str(Path(sys.executable).parent)]))
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = before


@functools.cache
def kernel() -> ModuleType | None:
    """The compiled kernel (loaded from the cache, or built once into it), or None where it cannot be built."""
    name = library_name()
    target = cache_dir() / f"{name}.so"
    try:
        return _import(name, target) if target.exists() else build(name, target)
    except Exception as error:  # no compiler, another architecture, a torch without headers: torch's path still works
        first = next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)
        log.warning("RMSNorm, rotary embedding, the causal softmax and SwiGLU stay on torch's slower CPU path: the "
                    "fused kernels (%s) could not be built: %s", SOURCE.name, first)
        return None


@contextlib.contextmanager
def torch_path():
    """Forwards inside take torch's operators even where a kernel applies: the side-by-side baseline for benchmarks
    and tests."""
    token = _torch_path.set(True)
    try:
        yield
    finally:
        _torch_path.reset(token)


def applies(x: torch.Tensor) -> bool:
    """Whether the kernels take x: eager, on a CPU, fp32 or bf16, and the kernels built."""
    return (x.device.type == "cpu" and x.dtype in DTYPES and not torch.compiler.is_compiling()
            and not _torch_path.get() and kernel() is not None)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
        x = x.contiguous()
        y, rstd = kernel().rms_norm_forward(x, weight, eps, dtype)
        ctx.save_for_backward(x, weight, rstd)
        ctx.dtype = dtype
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        dx, dweight = kernel().rms_norm_backward(dy, x, weight, rstd, ctx.dtype)
        return dx, dweight, None, None


def rms_norm_applies(x: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether `rms_norm` takes x with an output in `dtype`: `applies(x)`, and dtype x's own or bf16."""
    return applies(x) and dtype in (x.dtype, torch.bfloat16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype | None = None) -> torch.Tensor:
    """x / sqrt(mean(x², last dim) + eps) * weight, computed in fp32, rounded once to `dtype` (x's unless given):
    what `F.rms_norm(x.float(), ..., weight.float(), eps).to(dtype)` computes, in one pass each way. Only where
    `rms_norm_applies(x, dtype)`."""
    return _RMSNorm.apply(x, weight.float().contiguous(), eps, dtype or x.dtype)


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, weight, eps, heads_first):
        x = x.contiguous()
        y, rstd = kernel().rotary_forward(x, cos, sin, weight, eps, heads_first)
        ctx.save_for_backward(x, cos, sin, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, cos, sin, weight, rstd = ctx.saved_tensors
        dx, dweight = kernel().rotary_backward(dy, x, cos, sin, weight, rstd)
        return dx, None, None, None if weight is None else dweight, None, None


def rotary_applies(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether `rotary` takes x (..., heads, head_dim) with tables cos (..., head_dim): `applies(x)`, and cos's
    positions are x's last positions' dimensions (T for (B, T, heads, hd); B, T or N for per-token tables)."""
    positions = cos.shape[:-1]
    return (applies(x) and not cos.requires_grad and x.dim() >= len(positions) + 2
            and x.shape[x.dim() - 2 - len(positions):-2] == positions and x.shape[-1] % 2 == 0)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor | None = None,
           eps: float = 0.0, heads_first: bool = False) -> torch.Tensor:
    """x (..., heads, head_dim) rotated by the angles of cos/sin (positions..., head_dim), after an RMSNorm with
    `weight` if one is given: `apply_rotary(rms_norm(x))` computed in fp32 and rounded once to x's dtype, in one pass
    each way. Only where `rotary_applies(x, cos)`. heads_first (x (B, T, heads, head_dim)): the result, of x's shape,
    is stored heads first, so that its transpose(1, 2) is contiguous, as attention's matmuls read it."""
    head_dim = x.shape[-1]
    tables = (t.reshape(-1, head_dim).float().contiguous() for t in (cos, sin))
    return _Rotary.apply(x, *tables, None if weight is None else weight.float().contiguous(), eps, heads_first)


class _CausalSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores: torch.Tensor, first: int) -> torch.Tensor:
        weights = kernel().causal_softmax_forward(scores, first)
        ctx.save_for_backward(weights)
        return weights

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # ATen's: a loop of our own over only the weights a query sees (the zeros' gradients are zero) was slower
        (weights,) = ctx.saved_tensors
        return torch._softmax_backward_data(grad, weights, -1, weights.dtype), None


def causal_softmax(scores: torch.Tensor, first: int) -> torch.Tensor:
    """softmax(scores + the causal mask) over the last dimension for scores (..., queries, keys) of queries at
    positions first, first + 1, ..., each seeing the keys up to its own: kernels._causal_softmax's values (in fp32,
    rounded once), reading only the scores a query sees and writing zeros after them, where torch adds a mask tensor
    and runs its softmax over every score. Only where `applies(scores)`."""
    return _CausalSoftmax.apply(scores, first)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate, up = gate.contiguous(), up.contiguous()
        ctx.save_for_backward(gate, up)
        return kernel().swiglu_forward(gate, up)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return tuple(kernel().swiglu_backward(grad, *ctx.saved_tensors))


def swiglu_applies(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether `swiglu` takes gate and up: `applies(gate)`, and up of gate's shape and dtype."""
    return applies(gate) and up.shape == gate.shape and up.dtype == gate.dtype


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in one pass each way, computed in fp32 and rounded once, where torch runs silu, a product
    and three operators back (and keeps silu(gate) for them): the eager step 1-3% faster at d384 × 6 in bf16 and in
    fp32, 2-5% at tiny Shakespeare's 2-minute pick, side by side (benchmarks/README.md). Only where
    `swiglu_applies(gate, up)`."""
    return _SwiGLU.apply(gate, up)


def _probe(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 4


def _stands_in(line, written, fused, inputs: tuple, what: str) -> bool:
    """Whether the kernel `fused` computes what the model's `line` does (called as `written`) on the fp32 `inputs`,
    with a warning that names the line where not. The model writes each computation a kernel fuses in torch's
    operators, and the kernel stands in for that line only while the two agree: an edited line (another activation,
    another norm, another rotation) then runs as written on a CPU too, not silently the kernel's computation.
    `fused` is the kernel's autograd function itself, so that a probe is never counted as a forward's call."""
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        agree = torch.allclose(written(*inputs).float(), fused(*inputs).float(), rtol=1e-4, atol=1e-5)
    if not agree:
        log.warning("%s computes other values than %s: its fused CPU kernel is left out",
                    getattr(line, "__qualname__", line), what)
    return agree


@functools.cache
def computes_rms_norm(normalized) -> bool:
    """Whether `normalized(x, weight, eps, dtype)` (RMSNorm.normalized) computes what `rms_norm` does. Once per
    function."""
    return _stands_in(normalized, lambda x, w: normalized(x, w, 1e-6, x.dtype),
                      lambda x, w: _RMSNorm.apply(x, w, 1e-6, x.dtype), (_probe(8, 64, seed=0), _probe(64, seed=1)),
                      "RMSNorm")


@functools.cache
def computes_rotary(rotate) -> bool:
    """Whether `rotate(x, cos, sin)` (model.apply_rotary, tables broadcast over the heads) computes what `rotary`
    does without a norm (a fused norm is RMSNorm.normalized's, which computes_rms_norm checks). Once per function."""
    x, angles = _probe(2, 8, 3, 64, seed=0), _probe(8, 64, seed=1)
    return _stands_in(rotate, lambda x, cos, sin: rotate(x, cos.unsqueeze(-2), sin.unsqueeze(-2)),
                      lambda x, cos, sin: _Rotary.apply(x, cos, sin, None, 0.0, False), (x, angles.cos(), angles.sin()),
                      "the rotation of the two halves")


@functools.cache
def computes_swiglu(gated) -> bool:
    """Whether `gated(gate, up)` (SwiGLU.gated) computes what `swiglu` does, silu(gate) * up. Once per function."""
    return _stands_in(gated, gated, _SwiGLU.apply, (_probe(256, seed=0), _probe(256, seed=1)), "silu(gate) * up")


def prebuild() -> None:
    """`make setup`: build ahead of the first run (a machine that cannot still trains, on torch's path)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print("fused CPU kernels (RMSNorm, rotary, causal softmax, SwiGLU):", "ready" if kernel() is not None
          else "not available (torch's path is used)")
