"""The token embedding: nn.Embedding, whose gradient under `torch.compile` on a CPU is ATen's kernel, not Inductor's.

Why: Inductor writes the embedding's backward on a CPU as a scatter of every token's gradient row into the table with
one atomic add per element. At the issue's shape (2048 tokens of d384, vocabulary 4096, bf16 on an EPYC Zen 5)
that kernel took 2.7 ms a step, where ATen's `embedding_dense_backward`, which eager runs, takes 0.4 ms
(benchmarks/README.md). An opaque custom operator keeps Inductor from replacing it; the forward lookup stays
traceable, so Inductor still fuses it with the first norm. Eager runs and GPUs keep nn.Embedding's own path.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


@torch.library.custom_op("ultrathink::embedding_backward", mutates_args=())
def embedding_backward(grad: torch.Tensor, idx: torch.Tensor, rows: int) -> torch.Tensor:
    """The gradient of the table (rows, dim) of a lookup of `idx`, given the output's gradient (..., dim)."""
    return torch.ops.aten.embedding_dense_backward(grad, idx, rows, -1, False)


@embedding_backward.register_fake
def _(grad: torch.Tensor, idx: torch.Tensor, rows: int) -> torch.Tensor:
    return grad.new_empty((rows, grad.shape[-1]))


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, idx: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(idx)
        ctx.rows = weight.shape[0]
        return F.embedding(idx, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (idx,) = ctx.saved_tensors
        return None, embedding_backward(grad, idx, ctx.rows)


class Embedding(nn.Embedding):
    """nn.Embedding (no padding index, no max norm: as the model builds it), the same tensors and values; under
    `torch.compile` on a CPU its gradient is ATen's kernel (the module's docstring)."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() and self.weight.device.type == "cpu":
            return _Lookup.apply(idx, self.weight)
        return super().forward(idx)
