"""Optimizers: AdamW, Lion, or Muon (on the 2-D hidden matrices) with AdamW for the rest.

Weight decay only where it regularises: matrices of linear layers, not norms, biases or embeddings.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ultrathink.config import TrainConfig


def split_params(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter], list[nn.Parameter]]:
    """(hidden matrices, embeddings, vectors). The tied embedding is also the output layer: it is not 'hidden'."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    hidden, embed, vectors = [], [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if id(p) in embeddings:
            embed.append(p)
        elif p.dim() >= 2:
            hidden.append(p)
        else:
            vectors.append(p)
    return hidden, embed, vectors


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    hidden, embed, vectors = split_params(model)
    return [{"params": hidden, "weight_decay": weight_decay}, {"params": embed + vectors, "weight_decay": 0.0}]


def _adamw(groups: list[dict], cfg: TrainConfig) -> torch.optim.Optimizer:
    # fused kernels exist for CPU and CUDA in recent torch; they are the fastest path and numerically AdamW.
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=True)


def build_optimizers(model: nn.Module, cfg: TrainConfig) -> list[torch.optim.Optimizer]:
    """One optimizer, or two for Muon (which is defined only for 2-D matrices)."""
    if cfg.weight_decay is None:
        raise ValueError("train.weight_decay is null: the run's plan decides it from the epochs it trains "
                         "(ultrathink.train.plan.apply_plan); set a number to build optimizers without a plan")
    if cfg.optimizer == "adamw":
        return [_adamw(param_groups(model, cfg.weight_decay), cfg)]
    if cfg.optimizer == "lion":
        from lion_pytorch import Lion

        return [Lion(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))]
    hidden, embed, vectors = split_params(model)
    # match_rms_adamw scales Muon's update to AdamW's RMS, so one train.lr serves both optimizers.
    muon = torch.optim.Muon(hidden, lr=cfg.lr, weight_decay=cfg.weight_decay, adjust_lr_fn="match_rms_adamw")
    return [muon, _adamw([{"params": embed + vectors, "weight_decay": 0.0}], cfg)]
