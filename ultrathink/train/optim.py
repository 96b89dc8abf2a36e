"""AdamW with weight decay only where it regularises: matrices of linear layers, not norms, biases or embeddings."""

from __future__ import annotations

import torch
import torch.nn as nn

from ultrathink.config import TrainConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and id(p) not in embeddings else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             foreach=True)
