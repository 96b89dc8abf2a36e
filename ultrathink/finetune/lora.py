"""LoRA through PEFT on an UltraThink model: adapters on the named linear layers, the rest frozen; merged back
into plain weights for export, so a fine-tuned model loads, scores and exports like a pretrained one."""

from __future__ import annotations

import torch
from peft import LoraConfig, PeftModel, get_peft_model

from ultrathink.config import LoraSettings
from ultrathink.errors import StageError
from ultrathink.model import UltraThink


class AdapterError(StageError):
    """finetune.lora names layers the model does not have."""


def add_adapters(model: UltraThink, settings: LoraSettings) -> PeftModel:
    """Wrap `model` (in place: its linear layers gain adapters) and freeze every weight but the adapters'.
    Train `.get_base_model()`: the UltraThink module, whose forward and helpers the Trainer calls."""
    config = LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=list(settings.target_modules), bias="none")
    try:
        return get_peft_model(model, config)
    except ValueError as exc:
        names = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                        if isinstance(m, torch.nn.Linear)})
        raise AdapterError(f"finetune.lora.target_modules {list(settings.target_modules)}: {exc}; this model's "
                           f"linear layers are named {', '.join(names)}") from None


def merged(adapted: PeftModel) -> UltraThink:
    """The model with each adapter's update folded into its weight (W + alpha/r · B·A) and the adapters gone."""
    return adapted.merge_and_unload()


def trainable_share(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable parameters, all parameters)."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)
