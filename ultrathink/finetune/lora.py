"""LoRA through PEFT on an UltraThink model: adapters on the named linear layers, the rest frozen; merged back
into plain weights for export, so a fine-tuned model loads, scores and exports like a pretrained one.

finetune.quantize stores the frozen base's adapted layers quantized (QLoRA) with torchao, which runs on a CPU and a
GPU: int8 (weight-only, per-row scales) or nf4 (4-bit NormalFloat in blocks of 64). Measured against bitsandbytes
and optimum-quanto on this project's model (docs/finetuning.md): all train, but bitsandbytes' nf4 silently computes
wrong gradients after an eval pass on an AVX512-BF16 CPU unless a private flag is set, and quanto has no nf4. PEFT's
own merge re-quantizes (or fails on nf4), so `merged` adds each adapter's update to the dequantized weight itself.
"""

from __future__ import annotations

import math
import warnings

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer

from ultrathink.config import LoraSettings
from ultrathink.errors import StageError
from ultrathink.model import UltraThink


NF4_BLOCK = 64  # values per nf4 scale (QLoRA's block size)


class AdapterError(StageError):
    """finetune.lora names layers the model does not have."""


def add_adapters(model: UltraThink, settings: LoraSettings) -> PeftModel:
    """Wrap `model` (in place: its linear layers gain adapters) and freeze every weight but the adapters'.
    Train `.get_base_model()`: the UltraThink module, whose forward and helpers the Trainer calls."""
    config = LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=list(settings.target_modules), bias="none")
    try:
        with warnings.catch_warnings():  # PEFT warns that its merge cannot re-quantize: `merged` does not need it
            warnings.filterwarnings("ignore", message="TorchaoLoraLinear was instantiated")
            return get_peft_model(model, config)
    except ValueError as exc:
        names = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                        if isinstance(m, torch.nn.Linear)})
        raise AdapterError(f"finetune.lora.target_modules {list(settings.target_modules)}: {exc}; this model's "
                           f"linear layers are named {', '.join(names)}") from None


def quantize_base(model: UltraThink, mode: str, targets: list[str]) -> tuple[int, int]:
    """Replace the weights of `model`'s linear layers named in `targets` by their `mode` (int8 | nf4) quantized
    form, frozen; (bytes before, bytes after) of those weights."""
    layers = [m for name, m in model.named_modules()
              if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets]
    before = sum(m.weight.numel() * m.weight.element_size() for m in layers)
    if mode == "int8":
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        # set_inductor_config=False: the default changes torch.compile's global settings for the whole process.
        chosen = set(layers)
        quantize_(model, Int8WeightOnlyConfig(set_inductor_config=False), filter_fn=lambda module, _: module in chosen)
    else:
        from torchao.quantization import to_nf4

        for m in layers:
            blocks = m.weight.numel() // NF4_BLOCK
            if m.weight.numel() % NF4_BLOCK:
                raise AdapterError(f"finetune.quantize nf4: a weight of {tuple(m.weight.shape)} does not split into "
                                   f"blocks of {NF4_BLOCK} values (use int8)")
            # Each block's scale is itself quantized in groups of up to 256 scales (QLoRA's double quantization).
            weight = to_nf4(m.weight.detach().float(), NF4_BLOCK, math.gcd(blocks, 256))
            m.weight = torch.nn.Parameter(weight, requires_grad=False)
    model._register_state_dict_hook(_drop_quantized)
    model.register_load_state_dict_post_hook(_quantized_not_missing)
    return before, sum(quantized_bytes(m.weight) for m in layers)


def quantized_bytes(weight: torch.Tensor) -> int:
    """Bytes a (possibly quantized) weight stores: the packed values and their scales."""
    inner = getattr(weight, "__tensor_flatten__", None)
    if inner is None:
        return weight.numel() * weight.element_size()
    names, _ = inner()
    return sum(quantized_bytes(getattr(weight, name)) for name in names)


def is_quantized(weight: torch.Tensor) -> bool:
    """A torchao quantized weight (a tensor subclass: the only ones an adapted model holds)."""
    return type(weight) not in (torch.Tensor, torch.nn.Parameter)


def plain_weight(weight: torch.Tensor) -> torch.Tensor:
    """A weight as an ordinary fp32 tensor (quantized ones dequantized)."""
    if not is_quantized(weight):
        return weight
    if hasattr(weight, "get_original_weight"):  # torchao's NF4Tensor
        return weight.get_original_weight().float()
    return weight.dequantize().float()  # torchao's int8 weight-only tensor


def _drop_quantized(module, state_dict, prefix, local_metadata) -> None:
    """state_dict hook: leave the frozen quantized weights out of checkpoints. They follow from the base model
    and finetune.quantize, which the checkpoint folder's fingerprint names; safetensors could not store them."""
    for key in [k for k, v in state_dict.items() if is_quantized(v)]:
        del state_dict[key]


def _quantized_not_missing(module, incompatible) -> None:
    """load_state_dict hook: a checkpoint without the frozen quantized weights (see _drop_quantized) is whole."""
    def frozen(key: str) -> bool:
        try:
            return is_quantized(module.get_parameter(key))
        except AttributeError:
            return False

    incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if not frozen(k)]


def merged(adapted: PeftModel) -> UltraThink:
    """The model with each adapter's update folded into its weight (W + alpha/r · B·A) and the adapters gone; a
    quantized base's weights are dequantized first, so the result is a plain model in every case."""
    layers = [m for m in adapted.modules() if isinstance(m, LoraLayer)]
    if not any(is_quantized(m.get_base_layer().weight) for m in layers):
        return adapted.merge_and_unload()
    with torch.no_grad():
        for layer in layers:
            base = layer.get_base_layer()
            weight = plain_weight(base.weight) + layer.get_delta_weight("default").float()
            base.weight = torch.nn.Parameter(weight, requires_grad=False)
    return adapted.unload()


def trainable_share(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable parameters, all parameters)."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)
