"""The fused CPU kernels (ultrathink/model/cpu_kernels.py): RMSNorm, rotary embedding after an optional RMSNorm,
matmul attention's causal softmax and SwiGLU's gate, with the values and gradients of torch's operators, taken where
they apply and not elsewhere, nor where the model's line they stand in for was edited; a machine that cannot build
them (or builds them twice at once, or is killed mid-build) still trains."""

import functools
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ultrathink.config import ModelConfig
from ultrathink.model import UltraThink, cpu_kernels
from ultrathink.model.model import RMSNorm, apply_rotary

needs_kernel = pytest.mark.skipif(cpu_kernels.kernel() is None, reason="no C++ compiler here: the kernel cannot build")

EPS = 1e-6


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """RMSNorm in float64: the yardstick both paths are held to."""
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()


def values_and_grads(norm, x: torch.Tensor, weight: torch.Tensor, upstream: torch.Tensor):
    x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
    y = norm(x, weight)
    y.backward(upstream.to(y.dtype))
    return y, x.grad, weight.grad


def fused(x, weight):
    return cpu_kernels.rms_norm(x, weight, EPS)


def torch_rms_norm(x, weight):
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), EPS).to(x.dtype)


@needs_kernel
@pytest.mark.parametrize("shape", [(4, 33, 384), (2, 17, 6, 64), (5, 1, 1000)])
def test_fp32_values_and_gradients_match_float64(shape):
    torch.manual_seed(0)
    x = torch.randn(shape) * 3 + 0.5
    weight = torch.randn(shape[-1])
    upstream = torch.randn(shape)
    y, dx, dw = values_and_grads(fused, x, weight, upstream)
    y64, dx64, dw64 = values_and_grads(reference, x.double(), weight.double(), upstream.double())
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), y64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx.double(), dx64, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dw.double(), dw64, rtol=1e-4, atol=1e-4)
    # and no further from float64 than torch's own fp32 path
    y_torch, dx_torch, _ = values_and_grads(torch_rms_norm, x, weight, upstream)
    assert (y.double() - y64).abs().max() <= 4 * (y_torch.double() - y64).abs().max() + 1e-6
    assert (dx.double() - dx64).abs().max() <= 4 * (dx_torch.double() - dx64).abs().max() + 1e-6


@needs_kernel
def test_bf16_rounds_as_torch_does():
    """bf16 in, bf16 out, statistics in fp32: within one bf16 rounding of torch's path, gradients included."""
    torch.manual_seed(1)
    x = (torch.randn(3, 29, 4, 64) * 2).bfloat16()
    weight = torch.rand(64) + 0.5
    upstream = torch.randn(x.shape)
    y, dx, dw = values_and_grads(fused, x, weight, upstream)
    y_torch, dx_torch, dw_torch = values_and_grads(torch_rms_norm, x, weight, upstream)
    assert y.dtype == dx.dtype == torch.bfloat16 and dw.dtype == torch.float32
    torch.testing.assert_close(y, y_torch, rtol=2 ** -7, atol=1e-3)
    torch.testing.assert_close(dx, dx_torch, rtol=2 ** -6, atol=1e-2)
    torch.testing.assert_close(dw, dw_torch, rtol=1e-3, atol=1e-2)
    nan = fused(torch.full((1, 64), float("nan"), dtype=torch.bfloat16), weight)
    assert nan.isnan().all()


@needs_kernel
def test_fp32_in_bf16_out_rounds_once():
    """An fp32 input normalised into a bf16 output (a norm feeding matmuls under bf16 autocast): within one bf16
    rounding of float64, the gradient (bf16 in, fp32 out) as close to float64 as torch's path gets."""
    torch.manual_seed(4)
    x = torch.randn(4, 33, 384) * 3 + 0.5
    weight = torch.rand(384) + 0.5
    upstream = torch.randn(x.shape).bfloat16()
    to_bf16 = lambda x, w: cpu_kernels.rms_norm(x, w, EPS, torch.bfloat16)  # noqa: E731
    torch_to_bf16 = lambda x, w: torch_rms_norm(x, w).bfloat16()  # noqa: E731
    y, dx, dw = values_and_grads(to_bf16, x, weight, upstream)
    y_torch, dx_torch, _ = values_and_grads(torch_to_bf16, x, weight, upstream)
    y64, dx64, dw64 = values_and_grads(reference, x.double(), weight.double(), upstream.double())
    assert y.dtype == torch.bfloat16 and dx.dtype == dw.dtype == torch.float32
    torch.testing.assert_close(y.double(), y64, rtol=2 ** -8, atol=1e-6)
    assert (y != y_torch).float().mean() < 0.01  # the same rounding of nearly the same fp32 value
    torch.testing.assert_close(dx.double(), dx64, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dw.double(), dw64, rtol=1e-4, atol=1e-4)
    assert (dx.double() - dx64).abs().max() <= 4 * (dx_torch.double() - dx64).abs().max() + 1e-6
    with pytest.raises(RuntimeError, match="in bf16 from fp32"):  # nothing else is compiled
        cpu_kernels.kernel().rms_norm_forward(x.bfloat16(), weight, EPS, torch.float32)


@needs_kernel
def test_non_contiguous_input():
    torch.manual_seed(2)
    x = torch.randn(6, 64, 8).transpose(1, 2)  # last dim strided
    weight = torch.randn(64)
    upstream = torch.randn(x.shape)
    y, dx, dw = values_and_grads(fused, x, weight, upstream)
    y64, dx64, dw64 = values_and_grads(reference, x.double(), weight.double(), upstream.double())
    torch.testing.assert_close(y.double(), y64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx.double(), dx64, rtol=1e-4, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("qk_norm", [True, False])
def test_the_model_takes_them_and_trains_alike(monkeypatch, qk_norm):
    """An eager CPU model runs its norms, rotations and SwiGLU gates through the kernels; its loss and every
    gradient match torch's path."""
    assert cpu_kernels.applies(torch.ones(2, 8))
    with cpu_kernels.torch_path():
        assert not cpu_kernels.applies(torch.ones(2, 8))
    assert not cpu_kernels.applies(torch.ones(2, 8, dtype=torch.float16))
    cfg = ModelConfig(d_model=64, n_layers=2, n_heads=2, n_kv_heads=1, seq_len=32, dropout=0.0, qk_norm=qk_norm)
    torch.manual_seed(3)
    model = UltraThink(cfg, 97)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.3 * torch.randn_like(p))  # norm weights away from 1: a skipped weight would show
    tokens = torch.randint(0, 97, (3, 32))
    q, k, _ = model.blocks[0].attn.project(torch.randn(3, 32, 64), *model.rotary(0, 32))
    assert q.transpose(1, 2).is_contiguous() and k.transpose(1, 2).is_contiguous()  # attention's matmuls copy neither
    calls = {"rms_norm": 0, "rotary": 0, "swiglu": 0}
    for name in calls:
        monkeypatch.setattr(cpu_kernels, name, counted(calls, name, getattr(cpu_kernels, name)))
    loss = model(tokens, tokens).loss
    # per layer: two block norms, the rotation of queries and keys (each after its norm) and the MLP's gate; the
    # final norm
    assert calls == {"rms_norm": 2 * 2 + 1, "rotary": 2 * 2, "swiglu": 2}
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with cpu_kernels.torch_path():
        torch_loss = model(tokens, tokens).loss
        torch_loss.backward()
    torch.testing.assert_close(loss, torch_loss, rtol=1e-6, atol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


def counted(calls: dict, name: str, function):
    def call(*args, **kwargs):
        calls[name] += 1
        return function(*args, **kwargs)
    return call


def rotary_reference(x, cos, sin, weight):
    """apply_rotary(RMSNorm(x)) in float64, tables broadcast over the heads."""
    normed = x if weight is None else reference(x, weight)
    return apply_rotary(normed.double(), cos.double().unsqueeze(-2), sin.double().unsqueeze(-2))


def rotary_tables(positions: tuple, head_dim: int):
    angles = torch.rand(*positions, head_dim // 2) * 6
    angles = torch.cat([angles, angles], -1)  # rotate_half's pairing, as the model's tables are
    return angles.cos(), angles.sin()


@needs_kernel
@pytest.mark.parametrize("normed", [True, False])
@pytest.mark.parametrize("shape,positions", [((3, 11, 4, 32), (11,)),  # (B, T, heads, hd), one table for all
                                             ((3, 11, 2, 64), (3, 11)),  # a table per sequence (per-token positions)
                                             ((7, 3, 16), (7,))])  # a flat set of tokens (routed blocks)
def test_rotary_matches_float64(shape, positions, normed):
    torch.manual_seed(4)
    x, upstream = torch.randn(shape) * 2, torch.randn(shape)
    cos, sin = rotary_tables(positions, shape[-1])
    weight = torch.rand(shape[-1]) + 0.5
    assert cpu_kernels.rotary_applies(x, cos)

    def fused_rotary(x, w):
        return cpu_kernels.rotary(x, cos, sin, *((w, EPS) if normed else ()))

    def float64(x, w):
        return rotary_reference(x, cos, sin, w if normed else None)

    y, dx, dw = values_and_grads(fused_rotary, x, weight, upstream)
    y64, dx64, dw64 = values_and_grads(float64, x.double(), weight.double(), upstream.double())
    torch.testing.assert_close(y.double(), y64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx.double(), dx64, rtol=1e-4, atol=1e-5)
    if normed:
        torch.testing.assert_close(dw.double(), dw64, rtol=1e-4, atol=1e-4)
    else:
        assert dw is None and dw64 is None


@needs_kernel
def test_rotary_bf16_and_where_it_does_not_apply():
    torch.manual_seed(5)
    x = (torch.randn(2, 9, 3, 64) * 2).bfloat16()
    cos, sin = rotary_tables((9,), 64)
    weight = torch.rand(64) + 0.5
    y = cpu_kernels.rotary(x, cos, sin, weight, EPS)
    y64 = rotary_reference(x.double(), cos, sin, weight.double())
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), y64, rtol=2 ** -7, atol=2e-2)  # one rounding of the result
    assert not cpu_kernels.rotary_applies(x, cos[:5])  # the tables do not cover the positions
    assert not cpu_kernels.rotary_applies(x, torch.randn(2, 64))
    assert not cpu_kernels.rotary_applies(x, cos.clone().requires_grad_())
    assert not cpu_kernels.rotary_applies(x[..., :63], cos[..., :63])  # an odd head size


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_heads_first_stores_the_same_values_for_attention_and_reads_its_gradient_in_place(dtype):
    """heads_first: the same values, stored so that the (B, heads, T, hd) transpose attention's matmuls take is
    contiguous (no copy before them); and a gradient that comes back in that layout is read through its strides,
    with the same bits as the same gradient packed."""
    torch.manual_seed(6)
    x = (torch.randn(3, 11, 4, 32) * 2).to(dtype)
    cos, sin = rotary_tables((11,), 32)
    weight = torch.rand(32) + 0.5
    packed = cpu_kernels.rotary(x, cos, sin, weight, EPS)
    first = cpu_kernels.rotary(x, cos, sin, weight, EPS, heads_first=True)
    assert torch.equal(first, packed) and first.shape == packed.shape == x.shape
    assert first.transpose(1, 2).is_contiguous() and not packed.transpose(1, 2).is_contiguous()

    upstream = torch.randn(3, 4, 11, 32).to(dtype).transpose(1, 2)  # as attention's matmuls hand it back

    def grads(up, heads_first):
        leaf, w = x.clone().requires_grad_(), weight.clone().requires_grad_()
        cpu_kernels.rotary(leaf, cos, sin, w, EPS, heads_first=heads_first).backward(up)
        return leaf.grad, w.grad

    expected = grads(upstream.contiguous(), False)
    for heads_first in (True, False):
        for got, want in zip(grads(upstream, heads_first), expected):
            assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="heads first"):
        cpu_kernels.rotary(x[0], cos, sin, weight, EPS, heads_first=True)  # (T, heads, hd): no batch to go under


@needs_kernel
@pytest.mark.parametrize("rotary", [False, True])
def test_the_rows_are_split_over_torchs_threads_each_summing_its_own_weight_gradient(rotary):
    """On two of torch's threads each takes half of the rows (at::parallel_for's split): the outputs are those of
    one thread, bit for bit, and the weight's gradient is the two halves' sums added in thread order, so a given
    thread count gives the same bits. The library built without OpenMP (until 2026-12-07) ran every row on one
    thread: its gradient is one running sum over all rows, and the last assertion fails."""
    torch.manual_seed(7)
    kernel = cpu_kernels.kernel()
    x = torch.randn(2, 48, 4, 64) if rotary else torch.randn(2, 96, 384)
    weight, upstream = torch.rand(x.shape[-1]) + 0.5, torch.randn(x.shape)
    cos, sin = rotary_tables((48,), 64)

    def run(rows: slice):
        if rotary:
            y, rstd = kernel.rotary_forward(x[rows], cos, sin, weight, EPS, False)
            return (y, *kernel.rotary_backward(upstream[rows], x[rows], cos, sin, weight, rstd))
        y, rstd = kernel.rms_norm_forward(x[rows], weight, EPS, torch.float32)
        return (y, *kernel.rms_norm_backward(upstream[rows], x[rows], weight, rstd, torch.float32))

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone, first_half, second_half = run(slice(None)), run(slice(0, 1)), run(slice(1, 2))
        torch.set_num_threads(2)
        y, dx, dw = run(slice(None))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(y, alone[0]) and torch.equal(dx, alone[1])
    assert torch.equal(dw, first_half[2] + second_half[2])


@needs_kernel
@pytest.mark.parametrize("queries,keys,first", [(37, 37, 0),  # a whole window: rows of every length modulo 16
                                                (5, 40, 35),  # the last block of a longer window (matmul_attention)
                                                (9, 4, 0)])  # more queries than keys: the last ones see every key
def test_causal_softmax_matches_float64_and_rounds_as_torch_does(queries, keys, first):
    """Matmul attention's causal softmax through the kernel: in fp32 the weights and the scores' gradient are the
    float64 softmax's over the keys each query sees, and exact zeros after them (not e^-87); in bf16 the weights
    are rounded once, the same bits as torch's mask add and softmax in bf16 on nearly every weight."""
    from ultrathink.model.kernels import _causal_softmax

    torch.manual_seed(8)
    scores, upstream = torch.randn(2, 3, queries, keys) * 4, torch.randn(2, 3, queries, keys)

    def weights_and_grad(scores):
        leaf = scores.detach().requires_grad_()
        weights = _causal_softmax(leaf, first)
        weights.backward(upstream.to(weights.dtype))
        return weights, leaf.grad

    weights, grad = weights_and_grad(scores)
    with cpu_kernels.torch_path():
        weights64, grad64 = weights_and_grad(scores.double())
        torch_bf16 = _causal_softmax(scores.bfloat16(), first)
        exact_of_bf16 = _causal_softmax(scores.bfloat16().double(), first)
    unseen = torch.ones(queries, keys, dtype=torch.bool).triu(first + 1).expand_as(scores)
    assert unseen.any() and torch.equal(weights64[unseen], torch.zeros_like(weights64[unseen]))
    assert torch.equal(weights[unseen], torch.zeros_like(weights[unseen]))
    torch.testing.assert_close(weights.double(), weights64, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad.double(), grad64, rtol=1e-5, atol=1e-6)
    ours_bf16 = _causal_softmax(scores.bfloat16(), first)
    assert ours_bf16.dtype == torch.bfloat16 and torch.equal(ours_bf16[unseen], torch_bf16[unseen])
    assert (ours_bf16 == torch_bf16).float().mean() > 0.99
    torch.testing.assert_close(ours_bf16.double(), exact_of_bf16, rtol=2 ** -8, atol=1e-30)  # one rounding


@needs_kernel
def test_matmul_attention_takes_the_causal_softmax_kernel_in_each_block(monkeypatch):
    """Eager on a CPU, matmul attention's causal softmax is the kernel's, once per block of queries (256, then
    the last 44 of 300), and the attention is SDPA's."""
    from ultrathink.model.kernels import matmul_attention

    calls = {"causal_softmax": 0}
    monkeypatch.setattr(cpu_kernels, "causal_softmax", counted(calls, "causal_softmax", cpu_kernels.causal_softmax))
    generator = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 2, 300, 8, generator=generator) for _ in range(3))
    torch.testing.assert_close(matmul_attention(q, k, v, is_causal=True),
                               F.scaled_dot_product_attention(q, k, v, is_causal=True), rtol=1e-5, atol=1e-6)
    assert calls == {"causal_softmax": 2}


@needs_kernel
def test_swiglu_matches_float64_and_rounds_once_in_bf16():
    """silu(gate) * up and both gradients: in fp32 float64's values (gates far into both tails included, where e^-g
    would overflow); in bf16 the value rounded once, at least as close to float64's as torch's two roundings; and
    it takes only a CPU gate and up of one shape and dtype."""
    torch.manual_seed(10)
    tails = torch.tensor([-200.0, -88.0, -30.0, 0.0, 30.0, 200.0]).expand(3, 7, 6)
    gate = torch.cat([torch.randn(3, 7, 40) * 3, tails], -1)
    up, upstream = torch.randn(gate.shape), torch.randn(gate.shape)

    def values_and_grads(function, gate, up):
        gate, up = gate.detach().requires_grad_(), up.detach().requires_grad_()
        h = function(gate, up)
        h.backward(upstream.to(h.dtype))
        return h, gate.grad, up.grad

    exact = values_and_grads(lambda g, u: F.silu(g) * u, gate.double(), up.double())
    for got, want in zip(values_and_grads(cpu_kernels.swiglu, gate, up), exact):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    ours = values_and_grads(cpu_kernels.swiglu, gate.bfloat16(), up.bfloat16())
    exact_of_bf16 = values_and_grads(lambda g, u: F.silu(g) * u, gate.bfloat16().double(), up.bfloat16().double())
    theirs = values_and_grads(lambda g, u: F.silu(g) * u, gate.bfloat16(), up.bfloat16())
    torch.testing.assert_close(ours[0].double(), exact_of_bf16[0], rtol=2 ** -8, atol=1e-30)  # one rounding
    for got, torchs, want in zip(ours, theirs, exact_of_bf16):
        assert got.dtype == torch.bfloat16
        assert (got.double() - want).abs().sum() <= (torchs.double() - want).abs().sum()
    assert cpu_kernels.swiglu_applies(gate, up)
    assert not cpu_kernels.swiglu_applies(gate, up.bfloat16())
    assert not cpu_kernels.swiglu_applies(gate.half(), up.half())
    assert not cpu_kernels.swiglu_applies(gate, up[..., :5])


def runs_as_edited(monkeypatch, caplog, kernel: str, forward, edit, edited_line: str):
    """What forward() returns after edit() (the model's line that the kernel `kernel` stands in for replaced by the
    function named `edited_line`), checking that before it forward() takes that kernel, and after it neither forward
    runs the kernel, one warning names the edited line, and two forwards agree."""
    calls = {kernel: 0}
    monkeypatch.setattr(cpu_kernels, kernel, counted(calls, kernel, getattr(cpu_kernels, kernel)))
    forward()
    taken = calls[kernel]
    assert taken > 0
    edit()
    with caplog.at_level("WARNING", logger=cpu_kernels.__name__):
        edited, again = forward(), forward()
    assert calls[kernel] == taken  # the forwards ran the edited line
    torch.testing.assert_close(edited, again, rtol=0, atol=0)
    warned = [r.getMessage() for r in caplog.records if "its fused CPU kernel is left out" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith(f"{edited_line} computes other values than")
    return edited


def fresh(function):
    """A function of its own, under `function`'s name, that calls it: computes_* probe each function once in a
    process, so an edit that another test (or parameter) installed before would not be probed, nor warned about,
    again."""
    return functools.wraps(function)(lambda *args: function(*args))


def gelu_gate(gate, up):
    return F.gelu(gate) * up


@needs_kernel
def test_an_edited_gate_runs_as_written_not_the_kernels_silu(monkeypatch, caplog):
    """The kernel stands in for SwiGLU.gated only while the two compute the same: a user who edits the gate (GELU
    for silu) gets GELU on a CPU too, with one warning, not silently the kernel's silu."""
    from ultrathink.model.model import SwiGLU

    torch.manual_seed(11)
    mlp, x = SwiGLU(16, 40), torch.randn(2, 5, 16)
    torch.testing.assert_close(mlp(x), mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x)))
    edited = runs_as_edited(monkeypatch, caplog, "swiglu", lambda: mlp(x),
                            lambda: monkeypatch.setattr(SwiGLU, "gated", staticmethod(fresh(gelu_gate))), "gelu_gate")
    torch.testing.assert_close(edited, mlp.down_proj(F.gelu(mlp.gate_proj(x)) * mlp.up_proj(x)))


def one_plus_weight(x, weight, eps, dtype):
    """Gemma's RMSNorm: its weight is an offset from 1."""
    return F.rms_norm(x.float(), (x.shape[-1],), 1 + weight.float(), eps).to(dtype)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_edited_norm_runs_as_written_not_the_kernels(monkeypatch, caplog, dtype):
    """RMSNorm.normalized edited (Gemma's 1 + weight) is what an eager CPU norm computes, in fp32 and bf16."""
    torch.manual_seed(7)
    norm = RMSNorm(48, EPS)
    with torch.no_grad():
        norm.weight.copy_(0.5 * torch.randn(48))
    x = torch.randn(4, 7, 48, dtype=dtype)
    edited = runs_as_edited(monkeypatch, caplog, "rms_norm", lambda: norm(x),
                            lambda: monkeypatch.setattr(RMSNorm, "normalized", staticmethod(fresh(one_plus_weight))),
                            "one_plus_weight")
    torch.testing.assert_close(edited, one_plus_weight(x, norm.weight, EPS, dtype))


def rotate_pairs(x, cos, sin):
    """GPT-J's rotary embedding: adjacent dimensions (2i, 2i + 1) rotate together, not the two halves."""
    pairs = x.unflatten(-1, (-1, 2))
    rotated = torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


def attention_as_edited(monkeypatch, caplog, edit, edited_line: str, qk_norm: bool, seed: int):
    """One attention layer's rotated queries and keys after `edit` (runs_as_edited, the rotary kernel's), and the
    same input's queries and keys as projected, before any norm or rotation; with the rotation's tables."""
    cfg = ModelConfig(d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, seq_len=16, dropout=0.0, qk_norm=qk_norm)
    torch.manual_seed(seed)
    net = UltraThink(cfg, 50)
    attn, x, (cos, sin) = net.blocks[0].attn, torch.randn(2, 16, 64), net.rotary(0, 16)
    with torch.no_grad():
        edited_q, edited_k, _ = runs_as_edited(monkeypatch, caplog, "rotary", lambda: attn.project(x, cos, sin),
                                               edit, edited_line)
        projected = attn.q_proj(x).view(2, 16, 4, 16), attn.k_proj(x).view(2, 16, 2, 16)
    return attn, (edited_q, edited_k), projected, (cos[:, None], sin[:, None])


@needs_kernel
@pytest.mark.parametrize("qk_norm", [True, False])
def test_an_edited_rotation_runs_as_written_not_the_kernels(monkeypatch, caplog, qk_norm):
    """model.apply_rotary edited (GPT-J's pairs for the two halves) is what an eager CPU attention rotates its
    queries and keys with, after their norms."""
    from ultrathink.model import model as model_module

    attn, edited, (q, k), tables = attention_as_edited(
        monkeypatch, caplog, lambda: monkeypatch.setattr(model_module, "apply_rotary", fresh(rotate_pairs)),
        "rotate_pairs", qk_norm, seed=5)
    with torch.no_grad():
        if qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        torch.testing.assert_close(edited, (rotate_pairs(q, *tables), rotate_pairs(k, *tables)))


@needs_kernel
def test_an_edited_norm_reaches_the_queries_and_keys_the_rotation_kernel_would_have_normed(monkeypatch, caplog):
    """The fused q/k norm and rotation stands in for RMSNorm.normalized too: with the norm edited (Gemma's
    1 + weight), attention's queries and keys are normed as edited, then rotated by apply_rotary."""
    attn, edited, (q, k), tables = attention_as_edited(
        monkeypatch, caplog, lambda: monkeypatch.setattr(RMSNorm, "normalized", staticmethod(fresh(one_plus_weight))),
        "one_plus_weight", qk_norm=True, seed=6)
    with torch.no_grad():
        q, k = (one_plus_weight(t, norm.weight, norm.eps, t.dtype) for t, norm in ((q, attn.q_norm), (k, attn.k_norm)))
        torch.testing.assert_close(edited, (apply_rotary(q, *tables), apply_rotary(k, *tables)))


def test_compiled_norm_takes_torch_path_in_one_graph():
    """Under torch.compile the norm is torch's form (Inductor fuses it): no graph break, the same values."""
    norm = RMSNorm(48, EPS)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48))
    x = torch.randn(4, 48)
    compiled = torch.compile(norm, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), norm(x), rtol=1e-5, atol=1e-5)


def test_the_cache_name_follows_source_and_machine(monkeypatch):
    name = cpu_kernels.library_name()
    monkeypatch.setattr(cpu_kernels, "cpu_features", lambda: "flags: fpu sse2")  # another machine class
    assert cpu_kernels.library_name() != name


BUILD = ("import logging, sys; logging.basicConfig(level=logging.INFO, format='%(message)s');"
         "import torch; from ultrathink.model import cpu_kernels;"
         "from ultrathink.model.model import RMSNorm, apply_rotary;"
         "k = cpu_kernels.kernel(); y = RMSNorm(8, 1e-6)(torch.ones(2, 8));"
         "print('kernel', k is not None, 'sum', round(y.sum().item(), 3))")


def start(env_changes: dict) -> subprocess.Popen:
    env = {**os.environ, **env_changes}
    return subprocess.Popen([sys.executable, "-c", BUILD], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


@pytest.mark.spawns
def test_no_compiler_falls_back_with_one_warning(tmp_path):
    done = start({"TORCH_EXTENSIONS_DIR": str(tmp_path), "CXX": str(tmp_path / "no-such-compiler")})
    out, _ = done.communicate(timeout=300)
    assert done.returncode == 0, out
    assert "kernel False sum 16.0" in out
    assert out.count("stay on torch's slower CPU path") == 1 and "cpu_kernels.cpp" in out
    assert not list((tmp_path / "ultrathink").glob("*.so"))


@pytest.mark.spawns
@pytest.mark.slow
@needs_kernel
def test_two_builds_at_once_and_one_killed(tmp_path):
    """Two processes find an empty cache and build together; one is killed mid-build. The other finishes, the cache
    holds one complete library, and the next process loads it without building. Their PATH has a C++ compiler but
    no ninja, as for a user who runs .venv/bin/ultrathink on a machine without a system ninja: the build finds the
    one installed beside the interpreter."""
    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in ("c++", "as", "ld"):  # the compiler driver and what it runs
        (tools / tool).symlink_to(shutil.which(tool))
    assert shutil.which("ninja", path=str(tools)) is None and shutil.which("ninja", path=Path(sys.executable).parent)
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path), "PATH": str(tools)}
    killed, survivor = start(env), start(env)
    time.sleep(3)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait(timeout=60)
    out, _ = survivor.communicate(timeout=600)
    assert survivor.returncode == 0, out
    assert "kernel True sum 16.0" in out and "built the fused CPU kernels" in out
    [library] = (tmp_path / "ultrathink").glob("*.so")
    assert library.name == f"{cpu_kernels.library_name()}.so"
    again = start(env)
    out, _ = again.communicate(timeout=300)
    assert "kernel True sum 16.0" in out and "built" not in out
