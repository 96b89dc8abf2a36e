"""Hugging Face checkpoints of the Llama family, read as UltraThink models: Llama 2/3/3.1+ (rope_scaling llama3 or
linear), Mistral, Qwen2/Qwen2.5 (biased q/k/v projections), Qwen3 (q/k norms; where its head_dim is
hidden/heads), SmolLM/SmolLM2 and TinyLlama; grouped-query attention,
tied or untied embeddings, any rope_theta.

The math is the same (ultrathink/model/model.py follows LlamaForCausalLM), so reading one is a mapping of its
config.json onto ModelConfig and a renaming of its tensors. Anything the model cannot compute exactly — another
model_type, another activation, biases elsewhere, a head size other than hidden/heads, a sliding window narrower than
the context — is refused before any weight is read, naming the config key and what is supported.

Weights are read with safetensors only (a pytorch_model.bin would be unpickled: refused), shard by shard when the
checkpoint is sharded (model.safetensors.index.json), straight into the model's parameters: no second full copy.
They are read into memory (safetensors' pread backend), not mapped: a mapped parameter would be the file itself, so
rewriting the checkpoint in place (cp over it) would change or crash a loaded model, and a cast would keep the
mapped pages next to the cast copy (1.5× the fp32 weights measured, 1.01× read; benchmarks/import_memory.py).
This module knows nothing of the UltraThink class (model.py imports it), only of names and shapes.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open

from ultrathink.config import ModelConfig
from ultrathink.config.schema import RopeScaling
from ultrathink.errors import StageError
from ultrathink.hashing import file_sha256, files_hash

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")  # model_type values read
SLIDING_SWITCH = ("qwen2", "qwen3")  # model types whose sliding_window applies only with use_sliding_window
ROPE_TYPES = ("default", "llama3", "linear")

# Our tensor names → transformers' (Llama, Mistral, Qwen2 and, for export, Mixtral), applied in this order.
OURS_TO_HF = (("embed.", "model.embed_tokens."), ("blocks.", "model.layers."), ("attn_norm", "input_layernorm"),
              ("mlp_norm", "post_attention_layernorm"), (".attn.", ".self_attn."), (".mlp.router.", ".mlp.gate."))


class UnsupportedModelError(StageError):
    """The checkpoint uses something the UltraThink model cannot compute; the message names the config key."""


def is_hf_checkpoint(directory: str | Path) -> bool:
    """A transformers model directory: a config.json naming a model_type (ours says format: ultrathink)."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        return False
    config = json.loads(path.read_text())
    return config.get("format") != "ultrathink" and "model_type" in config


def read_config(directory: str | Path) -> dict:
    return json.loads((Path(directory) / CONFIG_FILE).read_text())


def supported_line() -> str:
    return (f"supported: model_type {', '.join(SUPPORTED)} (Llama 2/3/3.1+, Mistral, Qwen2/2.5, Qwen3, SmolLM, "
            "TinyLlama) "
            f"with hidden_act silu, rope types {', '.join(ROPE_TYPES)}")


def rope_settings(hf: dict) -> tuple[float, dict]:
    """(rope_theta, scaling dict or {}) from either layout: transformers ≥ 5 writes rope_parameters, older
    checkpoints rope_theta and rope_scaling."""
    params = hf.get("rope_parameters") or {}
    scaling = dict(hf.get("rope_scaling") or {}) or {k: v for k, v in params.items() if k != "rope_theta"}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    return float(theta), ({"type": rope_type, **scaling} if rope_type != "default" else {})


def context_length(hf: dict) -> int:
    """The positions the model attends over at once: max_position_embeddings, or its sliding window when narrower
    (UltraThink attends over the whole context, which equals a sliding window no wider than that context)."""
    context = int(hf.get("max_position_embeddings") or 2048)
    window = hf.get("sliding_window")
    if hf.get("model_type") in SLIDING_SWITCH and not hf.get("use_sliding_window", False):
        window = None
    if window and window < context:
        log.warning("%s: sliding_window %d is narrower than max_position_embeddings %d: the model's context is %d "
                    "tokens, where full attention is exactly the sliding window", hf.get("model_type"), window,
                    context, window)
        return int(window)
    return context


def problems(hf: dict) -> list[str]:
    """Why this config cannot be read exactly (empty: it can)."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED:
        return [f"model_type {model_type!r}: not a Llama-family decoder this model computes"]
    found = []
    if hf.get("hidden_act", "silu") != "silu":
        found.append(f"hidden_act {hf['hidden_act']!r}: the MLP is SwiGLU (silu)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            found.append(f"{key} true: only Qwen2's q/k/v biases are supported")
    heads, hidden = hf.get("num_attention_heads"), hf.get("hidden_size")
    if hf.get("head_dim") not in (None, hidden // heads):
        found.append(f"head_dim {hf['head_dim']}: must be hidden_size/num_attention_heads ({hidden // heads})")
    _, scaling = rope_settings(hf)
    if scaling and scaling["type"] not in ROPE_TYPES:
        found.append(f"rope_scaling type {scaling['type']!r}: supported {', '.join(ROPE_TYPES)}")
    if model_type in SLIDING_SWITCH and hf.get("use_sliding_window") and hf.get("max_window_layers", 0) < hf.get(
            "num_hidden_layers", 0):
        found.append("use_sliding_window with max_window_layers < num_hidden_layers: a window in only some layers")
    return found


def model_config(hf: dict, base: ModelConfig | None = None, source: str = "") -> tuple[ModelConfig, int]:
    """(ModelConfig, vocab_size) of a transformers config; UnsupportedModelError names what cannot be read. The
    keys that are not the architecture (dropout, init_std) come from `base` when given, else dropout is off."""
    found = problems(hf)
    if found:
        raise UnsupportedModelError(f"{source or 'checkpoint'}: cannot be read:\n" + "\n".join(
            f"  - {p}" for p in found) + f"\n{supported_line()}")
    theta, scaling = rope_settings(hf)
    kv_heads = hf.get("num_key_value_heads") or hf["num_attention_heads"]
    cfg = ModelConfig(
        d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"], n_heads=hf["num_attention_heads"],
        n_kv_heads=kv_heads, ffn_hidden=hf["intermediate_size"], seq_len=context_length(hf), rope_theta=theta,
        rope_scaling=RopeScaling(**{k: v for k, v in scaling.items() if k in RopeScaling.model_fields})
        if scaling else None,
        qkv_bias=hf["model_type"] == "qwen2", qk_norm=hf["model_type"] == "qwen3",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        dropout=base.dropout if base else 0.0, init_std=base.init_std if base else hf.get("initializer_range", 0.02))
    return cfg, int(hf["vocab_size"])


def hf_config_dict(cfg: ModelConfig) -> dict:
    """The transformers config keys of an UltraThink ModelConfig (shared by every exported architecture)."""
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        scaling = cfg.rope_scaling.model_dump()
        rope = {"rope_type": scaling.pop("type"), "rope_theta": cfg.rope_theta, **scaling}
    return dict(hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, max_position_embeddings=cfg.seq_len,
                rms_norm_eps=cfg.norm_eps, rope_parameters=rope, tie_word_embeddings=cfg.tie_embeddings)


def hf_name(ours: str) -> str:
    for old, new in OURS_TO_HF:
        ours = ours.replace(old, new)
    return "model.norm.weight" if ours == "norm.weight" else ours


def our_name(theirs: str) -> str:
    if theirs == "model.norm.weight":
        return "norm.weight"
    for old, new in reversed(OURS_TO_HF):
        theirs = theirs.replace(new, old)
    return theirs


def weight_files(directory: str | Path) -> list[Path]:
    """The checkpoint's safetensors files, in the index's order when sharded."""
    directory = Path(directory)
    if (directory / INDEX_FILE).is_file():
        weight_map = json.loads((directory / INDEX_FILE).read_text())["weight_map"]
        return [directory / name for name in dict.fromkeys(weight_map.values())]
    if (directory / SINGLE_FILE).is_file():
        return [directory / SINGLE_FILE]
    pickled = sorted(p.name for p in directory.glob("*.bin")) + sorted(p.name for p in directory.glob("*.pt*"))
    raise UnsupportedModelError(
        f"{directory}: no {SINGLE_FILE} or {INDEX_FILE}" + (
            f" ({', '.join(pickled[:3])} would be unpickled, which could run code: convert it to safetensors "
            "with transformers: model.save_pretrained(dir, safe_serialization=True))" if pickled else ""))


def weights_sha256(directory: str | Path) -> str:
    """The weights' identity: the sha256 of the safetensors file, or over a sharded checkpoint's files."""
    directory = Path(directory)
    files = weight_files(directory)
    return file_sha256(files[0]) if len(files) == 1 else files_hash(directory, [p.name for p in files])


# Tensors a checkpoint may carry that UltraThink derives instead (old Llama checkpoints store the rotary table).
DERIVED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def read_weights(directory: str | Path, expected: dict[str, torch.Tensor],
                 dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under our names, file by file (read, not mapped: see the module's docstring), cast
    to `dtype` when given. `expected` (a state_dict, may be on the meta device) names the
    tensors and shapes the model has; anything missing, extra or of another shape is an error naming it."""
    state: dict[str, torch.Tensor] = {}
    tied = "lm_head.weight" not in expected
    for path in weight_files(directory):
        with safe_open(str(path), framework="pt", device="cpu", backend="pread") as f:
            for key in f.keys():
                name = our_name(key)
                if DERIVED.search(key) or (tied and name == "lm_head.weight"):
                    continue
                if name in expected and tuple(f.get_slice(key).get_shape()) != tuple(expected[name].shape):
                    raise UnsupportedModelError(
                        f"{path.name}: {key} has shape {tuple(f.get_slice(key).get_shape())}, the config implies "
                        f"{tuple(expected[name].shape)}")
                tensor = f.get_tensor(key)
                state[name] = tensor if dtype is None else tensor.to(dtype)
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing or extra:
        raise UnsupportedModelError(f"{directory}: tensors do not match the config: " + "; ".join(
            f"{what}: {', '.join(hf_name(n) for n in names[:4])}{' ...' if len(names) > 4 else ''}"
            for what, names in (("missing", missing), ("unexpected", extra)) if names))
    return state

