"""Export an UltraThink model as a Hugging Face transformers directory (`ultrathink export`, and the registry's
hf/ artifact).

The dense model is a LlamaForCausalLM (same math, tensors renamed: hf.py), a Qwen2ForCausalLM when its q/k/v
projections carry biases (an imported Qwen2), or a Qwen3ForCausalLM with model.qk_norm; tied or untied embeddings
and rope scaling carry over. A model whose every block is an MoE layer is a MixtralForCausalLM: Mixtral routes
with softmax → top-k → renormalise over the chosen experts, which is what MoE does for top_k ≥ 2 without a
selection bias; Mixtral is dropless, as MoE is at inference.

Not exportable (ExportError says which): DRE routing (transformers has no Mixture-of-Depths model); MoE in only
some blocks (Mixtral's blocks are all MoE); top_k = 1 (MoE weights the expert by its probability, Mixtral by 1);
bias balancing (Mixtral chooses experts by probability alone); q/k/v biases or q/k norms with MoE (Mixtral has
neither); q/k/v biases with q/k norms (Qwen3 has no biases).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM, PretrainedConfig,
                          PreTrainedModel, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from ultrathink.io import atomic_dir
from ultrathink.model.hf import hf_config_dict, hf_name
from ultrathink.model.model import UltraThink
from ultrathink.model.moe import MoE
from ultrathink.model.routing import block_index
from ultrathink.tokenizer import load_tokenizer


class ExportError(ValueError):
    """The model uses something the target transformers architecture cannot express."""


def moe_layers(model: UltraThink) -> dict[int, MoE]:
    return {block_index(name): m for name, m in model.variants.items() if isinstance(m, MoE)}


def incompatibilities(model: UltraThink) -> list[str]:
    cfg, problems = model.cfg, []
    others = sorted({type(m).__name__ for m in model.variants.values() if not isinstance(m, MoE)})
    if others:
        problems.append(f"{', '.join(others)}: transformers has no such architecture (only Mixtral's MoE maps)")
    if moe_layers(model) and len(moe_layers(model)) != cfg.n_layers:
        problems.append(f"model.moe.every={cfg.moe.every}: Mixtral needs an MoE layer in every block (every=1)")
    if moe_layers(model) and cfg.moe.top_k == 1:
        problems.append("model.moe.top_k=1: MoE weights the one expert by its probability, Mixtral by 1")
    if moe_layers(model) and cfg.moe.bias_balancing:
        problems.append("model.moe.bias_balancing: Mixtral chooses experts by router probability alone")
    if moe_layers(model) and cfg.qkv_bias:
        problems.append("model.qkv_bias with MoE: Mixtral's attention has no biases")
    if moe_layers(model) and cfg.qk_norm:
        problems.append("model.qk_norm with MoE: Mixtral's attention has no q/k norms")
    if cfg.qk_norm and cfg.qkv_bias:
        problems.append("model.qk_norm with model.qkv_bias: Qwen3 (q/k norms) has no q/k/v biases")
    return problems


def architecture(model: UltraThink) -> tuple[type[PreTrainedModel], PretrainedConfig]:
    """The transformers class that computes what `model` computes, and its config."""
    cfg = model.cfg
    common = dict(hf_config_dict(cfg), vocab_size=model.vocab_size)
    if moe_layers(model):
        return MixtralForCausalLM, MixtralConfig(
            **common, intermediate_size=cfg.moe.expert_hidden or cfg.hidden, num_local_experts=cfg.moe.n_experts,
            num_experts_per_tok=cfg.moe.top_k, router_jitter_noise=0.0)
    if cfg.qkv_bias:
        return Qwen2ForCausalLM, Qwen2Config(**common, intermediate_size=cfg.hidden, use_sliding_window=False)
    if cfg.qk_norm:
        return Qwen3ForCausalLM, Qwen3Config(**common, intermediate_size=cfg.hidden, attention_bias=False,
                                             use_sliding_window=False)
    return LlamaForCausalLM, LlamaConfig(**common, intermediate_size=cfg.hidden)


def hf_state_dict(model: UltraThink) -> dict[str, torch.Tensor]:
    """Our tensors under transformers' names; each MoE layer's experts stacked the way Mixtral stores them."""
    state = {}
    for key, value in model.state_dict().items():
        if ".experts." in key or key.endswith(".select_bias"):
            continue
        state[hf_name(key)] = value
    for i, moe in moe_layers(model).items():
        prefix = f"model.layers.{i}.mlp.experts."
        state[prefix + "gate_up_proj"] = torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight])
                                                      for e in moe.experts])
        state[prefix + "down_proj"] = torch.stack([e.down_proj.weight for e in moe.experts])
    if model.cfg.tie_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def to_hf(model: UltraThink) -> PreTrainedModel:
    """The equivalent transformers model (Llama, Qwen2, Qwen3 or Mixtral) in the weights' dtype, in eval mode;
    ExportError if there is none."""
    problems = incompatibilities(model)
    if problems:
        raise ExportError("cannot export to transformers:\n" + "\n".join(f"  - {p}" for p in problems))
    cls, config = architecture(model)
    hf = cls._from_config(config, dtype=model.embed.weight.dtype)
    hf.load_state_dict(hf_state_dict(model), strict=True)
    return hf.eval()


def export_hf(model_dir: str | Path, tokenizer_dir: str | Path, out_dir: str | Path) -> Path:
    """Write model_dir's model as a transformers directory (safetensors, config.json, tokenizer files) that
    `AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained` load. Replaces out_dir."""
    hf = to_hf(UltraThink.from_pretrained(model_dir))
    tokenizer = load_tokenizer(tokenizer_dir)
    for config in (hf.config, hf.generation_config):
        config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
        config.pad_token_id = tokenizer.pad_token_id
    with atomic_dir(out_dir) as tmp:
        hf.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return Path(out_dir)
