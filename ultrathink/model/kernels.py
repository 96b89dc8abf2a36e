"""Which scaled-dot-product attention kernel a training run uses, chosen by measurement for its shape
(`train.attention: auto`), the way `train.precision: auto` chooses the dtype.

On a CPU the choice matters and flips with the shape: torch's flash kernel's backward is 2.4× slower in bf16 than in
fp32 at 16×128 tokens, 8 heads of 64 (benchmarks/moe_dre.py --attention), yet slightly faster at 8×256 tokens, 6
heads; the plain math path (matmuls and a softmax) wins at other shapes. Under bf16 neither of torch's CPU kernels
runs its matmuls in bf16 (math computes in fp32), so `matmul` writes attention as two matmuls and a softmax in the
inputs' dtype: bf16 matmuls run at twice fp32's rate there. So `auto` times forward+backward of each candidate —
flash or math, in the autocast dtype or in fp32, and matmul — on random tensors of the run's shape and keeps the
fastest. On a GPU torch's own choice (flash, cuDNN, memory-efficient) is already measured well: `auto` keeps it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
import warnings
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ultrathink.device import device_type, is_cuda, synchronize
from ultrathink.model import cpu_kernels

log = logging.getLogger(__name__)

_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}


@dataclass(frozen=True)
class AttentionKernel:
    backend: str = "torch"  # torch (SDPA's own choice) | flash | math | matmul (matmul_attention)
    fp32: bool = True  # on a CPU under bf16 autocast: attention in fp32, outside autocast (GPUs ignore it)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **sdpa) -> torch.Tensor:
        """F.scaled_dot_product_attention(q, k, v, **sdpa) with this backend, in fp32 where this kernel says so;
        the result in q's dtype. Plain `with` blocks, no ExitStack: torch.compile traces them, where entering
        autocast through an ExitStack broke the compiled graph at every attention call."""
        dtype = q.dtype
        attention = matmul_attention if self.backend == "matmul" else F.scaled_dot_product_attention
        if self.fp32 and q.device.type == "cpu" and dtype == torch.bfloat16:
            with torch.autocast("cpu", enabled=False), self.backend_scope():
                return attention(q.float(), k.float(), v.float(), **sdpa).to(dtype)
        with self.backend_scope():
            return attention(q, k, v, **sdpa).to(dtype)

    def backend_scope(self):
        return sdpa_kernel(_BACKENDS[self.backend]) if self.backend in _BACKENDS else contextlib.nullcontext()

    def to_dict(self) -> dict:
        return asdict(self)


def matmul_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                     dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                     enable_gqa: bool = False) -> torch.Tensor:
    """What F.scaled_dot_product_attention computes, with its arguments, as two matmuls in q's dtype and a softmax
    between them: q (..., heads, T, head_dim), k and v (..., kv_heads, S, head_dim). Under bf16 the scores are
    rounded to bf16 before the softmax (which accumulates in fp32), as attention written out in nanoGPT is under
    autocast; torch's CPU kernels keep them in fp32 and pay for it: 7.0 against 3.0 ms forward+backward at 16 ×
    3 heads × 128 tokens of 64 on an EPYC Zen 4, and at equal steps the loss was the same (benchmarks/README.md).
    A causal window longer than CAUSAL_BLOCK_MIN is computed in blocks of queries (causal_block). Eager, grouped-query
    heads (enable_gqa) are never repeated: each key head attends to its group's queries as one taller matrix
    (_weighted_values)."""
    if not enable_gqa and k.shape[-3] != q.shape[-3]:
        raise ValueError(f"{q.shape[-3]} query heads and {k.shape[-3]} key heads need enable_gqa")
    if k.shape[-3] != q.shape[-3] and torch.compiler.is_compiling():
        # Compiled, the step with keys and values repeated per head ran 3% faster than with the grouped matmuls, at
        # 4 heads, 2 kv, batch 16 × 256 tokens in bf16 on an AMX Xeon (benchmarks/README.md); eager, 3.8% slower.
        k, v = (t.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3) for t in (k, v))
    q = q * (scale if scale is not None else q.shape[-1] ** -0.5)
    length, block = q.shape[-2], causal_block(q.shape[-2])
    if not is_causal or k.shape[-2] != length or block >= length:
        return _weighted_values(q, k, v, attn_mask, dropout_p, is_causal)
    # Each block of queries against the keys up to its last one: the masked scores beyond are never computed. Made
    # contiguous once (the model passes heads transposed), not once per block's slice in its matmuls.
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return torch.cat([_weighted_values(q[..., start:start + block, :], k[..., :start + block, :],
                                       v[..., :start + block, :], None, dropout_p, True, first=start)
                      for start in range(0, length, block)], dim=-2)


# Causal attention over more than this many tokens runs in blocks of queries (matmul_attention), each block
# max(CAUSAL_BLOCK_MIN, T / 4) long: each skips the scores of the keys after its last query, so T / 4 saves 3/8 of
# the matmuls. Forward+backward in bf16, 6 heads of 64 at 2048 tokens per call, with the Trainer's allocator
# (keep_freed_host_memory), on an EPYC Zen 4 (benchmarks/README.md, sixty-ninth session), whole window against
# blocks of 128 / 256 / 512: 256 tokens 11.2 / 11.0 ms; 512 tokens 20.0 / 19.2 / 17.8; 1024 tokens 40.8 / 43.4 /
# 35.8 / 34.6; 2048 tokens 78.8 / 81.8 / 65.6 / 61.7. Below 256 tokens per block the smaller matmuls and the
# concatenation cost what the skipped scores save (the forty-first session found the same at 128 and 256 tokens).
CAUSAL_BLOCK_MIN = 256


def causal_block(length: int) -> int:
    """The query block matmul_attention takes over a causal window of `length` tokens (the whole window up to
    CAUSAL_BLOCK_MIN)."""
    return max(CAUSAL_BLOCK_MIN, length // 4)


def causal_softmax(scores: torch.Tensor, first: int) -> torch.Tensor:
    """softmax(scores + the causal mask) over the last dimension: scores (..., queries, keys) of queries at
    positions first, first + 1, ..., each seeing the keys up to its own. Compiled, it is an operator of its own
    (ultrathink::causal_softmax), so that the mask stays a tensor read from memory: traced, Inductor fused the
    mask's construction into the softmax as 64-bit index arithmetic on every score, and the compiled Trainer's step
    took 260.3 ms where the operator's took 237.7 at d384 × 6, batch 8 × 256 tokens, in bf16 on an AMX Xeon, side
    by side (benchmarks/README.md). Eager, it is the same function, without a custom operator's dispatch."""
    if torch.compiler.is_compiling():
        return torch.ops.ultrathink.causal_softmax(scores, first)
    return _causal_softmax(scores, first)


def _causal_softmax(scores: torch.Tensor, first: int) -> torch.Tensor:
    """On a CPU, the fused kernel (cpu_kernels.causal_softmax): the mask's add and torch's softmax in one pass over
    the scores each query sees (forward 0.84 ms against their 1.5 at 8 × 6 heads × 256 × 256 in bf16 on two threads
    of an AMX Xeon; tiny Shakespeare's 2-minute step 2-7% faster eager, 1.5-3% compiled: benchmarks/README.md).
    Elsewhere those two operators."""
    if cpu_kernels.applies(scores):
        return cpu_kernels.causal_softmax(scores, first)
    return torch.softmax(scores + _causal_mask(*scores.shape[-2:], first, scores.dtype, scores.device), dim=-1)


@functools.lru_cache(maxsize=8)
def _causal_mask(queries: int, keys: int, first: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """0 where query first + i may attend to key j (j ≤ first + i), -inf after: one per shape, as the graphs have."""
    return torch.full((queries, keys), float("-inf"), dtype=dtype, device=device).triu(first + 1)


def _save_weights(ctx, inputs, output) -> None:
    ctx.save_for_backward(output)


def _softmax_backward(ctx, grad: torch.Tensor):
    """Traceable: Inductor's fused softmax backward is faster than ATen's here."""
    (weights,) = ctx.saved_tensors
    return torch._softmax_backward_data(grad, weights, -1, weights.dtype), None


_opaque = torch.library.custom_op("ultrathink::causal_softmax", _causal_softmax, mutates_args=())
_opaque.register_fake(lambda scores, first: scores.new_empty(scores.shape))  # contiguous, as both paths give
_opaque.register_autograd(_softmax_backward, setup_context=_save_weights)


def _weighted_values(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     dropout_p: float, is_causal: bool, first: int = 0) -> torch.Tensor:
    """softmax(q·kᵀ + mask)·v for queries already scaled, the weights dropped out at dropout_p: q (..., heads, T, hd),
    k and v (..., kv_heads, S, hd), query head h reading key head h // (heads / kv_heads). Causal: the queries are
    positions first, first + 1, ... and see the keys up to their own (SDPA's alignment at the top left).

    The query heads that share a key head are one (groups × T, hd) matrix against it, so keys and values are never
    repeated per head, nor their gradients summed back over the copies: at tiny Shakespeare's 2-minute shape (4
    heads, 2 kv) repeat_interleave's backward alone took 5.6 ms of a 170 ms eager step (benchmarks/README.md). The
    scores are viewed (..., kv_heads, groups, T, S), so the causal mask and a mask over (T, S) broadcast as before."""
    groups, length = q.shape[-3] // k.shape[-3], q.shape[-2]
    # a view where q is contiguous, as the model's is; batch dimensions broadcast in the matmuls, as in SDPA
    rows = q.reshape(*q.shape[:-3], k.shape[-3], groups * length, q.shape[-1])
    scores = torch.matmul(rows, k.transpose(-1, -2)).unflatten(-2, (groups, length))
    # The mask is added, not filled in: 20% faster here. A boolean one (True: may attend) becomes 0 / -inf.
    if is_causal:
        weights = causal_softmax(scores, first)
    else:
        if mask is not None and mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=scores.dtype, device=q.device).masked_fill(~mask, float("-inf"))
        weights = torch.softmax(scores if mask is None else scores + grouped(mask, groups), dim=-1)
    weights = weights.to(v.dtype).flatten(-3, -2)
    if dropout_p:
        weights = F.dropout(weights, dropout_p)
    values = torch.matmul(weights, v)  # (..., kv_heads, groups × T, hd)
    return values.view(*values.shape[:-3], q.shape[-3], length, v.shape[-1])


def grouped(mask: torch.Tensor, groups: int) -> torch.Tensor:
    """A mask broadcastable to (..., heads, T, S), laid out for scores viewed (..., kv_heads, groups, T, S)."""
    if mask.dim() < 3 or mask.shape[-3] == 1:
        return mask.unsqueeze(-3)
    return mask.unflatten(-3, (mask.shape[-3] // groups, groups))


# Another kernel replaces the default (what a loaded model runs) only when it is at least this much faster: timings
# of close candidates swap places from run to run, and a choice that flips would make two runs of one
# configuration compute differently for nothing.
MIN_GAIN = 1.1


def candidates(setting: str, device: str, autocast_dtype: torch.dtype | None,
               dropout: float = 0.0) -> list[AttentionKernel]:
    """The default first (torch's choice, in fp32 on a CPU under bf16), then the alternatives `auto` times. matmul
    only under autocast: in fp32 it is the math kernel's arithmetic again, and where two kernels tie a timing that
    picks either makes two runs of one configuration compute differently (at a test's tiny fp32 shape it won in one
    process and lost in the next). Under attention dropout a CPU has no flash kernel and torch's choice is math in
    fp32, so flash and math in fp32 are left out: math in fp32 trains with the default's arithmetic, yet validation
    (no dropout) runs the default as flash, and a timing that picked math by noise made two runs of one
    configuration report different validation losses (tests/test_resume_kill.py, on a busy machine)."""
    if setting != "auto":
        return [AttentionKernel(setting, fp32=False)]
    if device_type(device) != "cpu":
        return [AttentionKernel("torch", fp32=False)]
    upcasts = (False, True) if autocast_dtype == torch.bfloat16 else (False,)
    options = [AttentionKernel(b, fp32) for b in _BACKENDS for fp32 in upcasts]
    if dropout:  # torch's choice is math in fp32: of flash and math, only math in bf16 computes differently
        options = [AttentionKernel("math", fp32=False)] if autocast_dtype == torch.bfloat16 else []
    return [AttentionKernel()] + options + ([AttentionKernel("matmul", False)] if autocast_dtype is not None else [])


def fixed_kernel(setting: str) -> AttentionKernel:
    """The kernel a run uses without measuring: the one `train.attention` names, or for `auto` the default."""
    return AttentionKernel() if setting == "auto" else AttentionKernel(setting, fp32=False)


def choose_attention(setting: str, batch: int, heads: int, kv_heads: int, seq_len: int, head_dim: int,
                     dropout: float, device: str, autocast_dtype: torch.dtype | None,
                     repeats: int = 5) -> tuple[AttentionKernel, dict[str, float]]:
    """The kernel for `train.attention` at this shape, and the measured milliseconds of each candidate.

    The rule: candidates in a fixed order (the default first); a later one replaces the pick so far only when it is
    MIN_GAIN× faster than it. Each candidate is run once untimed, then the candidates are timed in turn `repeats`
    times and each keeps its fastest time, so a cold first call or a passing stall does not decide. Near-ties are
    kept by the order, not by which timing happened to come out lower: under dropout (no CPU flash kernel) the
    default and math are the same kernel, and math in bf16 used to win or lose against math in fp32 by noise —
    two runs of one configuration then computed differently. The choice is still a measurement, so the train
    stage makes it once per configuration and machine class and records it (ultrathink/train/plan.py)."""
    options = candidates(setting, device, autocast_dtype, dropout)
    if len(options) == 1:
        return options[0], {}
    generator = torch.Generator(device=device).manual_seed(0)  # the global generators stay untouched
    dtype = autocast_dtype or torch.float32
    q = torch.randn(batch, heads, seq_len, head_dim, generator=generator, device=device, dtype=dtype)
    k, v = (torch.randn(batch, kv_heads, seq_len, head_dim, generator=generator, device=device, dtype=dtype)
            for _ in range(2))
    grad = torch.randn(q.shape, generator=generator, device=device, dtype=dtype)
    time_once = lambda option: _time_once(option, q, k, v, grad, dropout, autocast_dtype, device)  # noqa: E731
    runnable = []
    for option in options:
        try:
            with warnings.catch_warnings():  # torch warns, then raises, for a kernel that cannot run this case
                warnings.simplefilter("ignore", UserWarning)
                time_once(option)
            runnable.append(option)
        except torch.OutOfMemoryError:
            raise  # the run's own shape does not fit: no kernel choice will train it
        except RuntimeError as error:  # no such kernel for this shape or dropout (CPU flash has no dropout)
            log.info("attention auto: %s cannot run this case (%s)", label(option), str(error).splitlines()[0][:200])
    if not runnable:
        raise RuntimeError(f"no attention kernel of {options} runs at batch {batch} × {heads} heads × {seq_len} "
                           f"tokens on {device}")
    timings = {option: math.inf for option in runnable}
    for _ in range(repeats):
        for option in runnable:
            timings[option] = min(timings[option], time_once(option) * 1e3)
    chosen = runnable[0]
    for option in runnable[1:]:
        if timings[option] * MIN_GAIN <= timings[chosen]:
            chosen = option
    readable = {label(o): ms for o, ms in timings.items()}
    log.info("attention auto → %s (forward+backward ms at batch %d × %d heads × %d tokens: %s)", label(chosen),
             batch, heads, seq_len, ", ".join(f"{k} {v:.1f}" for k, v in readable.items()))
    return chosen, readable


def label(kernel: AttentionKernel) -> str:
    """`math/fp32`, `torch`: a kernel as logs and plans name it."""
    return f"{kernel.backend}{'/fp32' if kernel.fp32 else ''}"


def _time_once(option, q, k, v, grad, dropout, autocast_dtype, device) -> float:
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    started = time.perf_counter()
    with torch.random.fork_rng(devices=[torch.device(device).index or 0] if is_cuda(device) else []):
        with torch.autocast(device_type(device), dtype=autocast_dtype, enabled=autocast_dtype is not None):
            y = option.attend(q, k, v, is_causal=True, dropout_p=dropout, enable_gqa=q.shape[1] != k.shape[1])
        y.backward(grad.to(y.dtype))
    synchronize(device)
    return time.perf_counter() - started
