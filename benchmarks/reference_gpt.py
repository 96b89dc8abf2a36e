"""A nanoGPT-style GPT-2, written here as the yardstick the speed and quality benchmarks compare against: learned
positions, LayerNorm, one fused qkv projection, causal SDPA, GELU MLP 4× wide, tied output head, no biases (nanoGPT's
`bias=False`). Not part of the library; nothing in ultrathink/ imports it."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class SelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for t in self.qkv(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class GPTBlock(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d_model, bias=False), nn.LayerNorm(d_model, bias=False)
        self.attn = SelfAttention(d_model, n_heads)
        self.fc, self.out = nn.Linear(d_model, 4 * d_model, bias=False), nn.Linear(4 * d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, d_model: int, n_layers: int, n_heads: int, seq_len: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_size, d_model), nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(GPTBlock(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * n_layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))

    def optimizer(self, lr: float, weight_decay: float = 0.1) -> torch.optim.Optimizer:
        """nanoGPT's: AdamW, decay on matrices only, betas (0.9, 0.95); fused, as our trainer's."""
        decay = [p for p in self.parameters() if p.dim() >= 2]
        rest = [p for p in self.parameters() if p.dim() < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                  {"params": rest, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95), fused=True)
