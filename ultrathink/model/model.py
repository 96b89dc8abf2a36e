"""The UltraThink decoder: a Llama-style stack, dense path.

token embedding → N × [RMSNorm → grouped-query attention (q/k RMSNorm, then RoPE) → residual,
                       RMSNorm → SwiGLU MLP → residual] → RMSNorm → tied output projection.

The math follows Hugging Face's LlamaForCausalLM exactly (rotate-half RoPE, RMSNorm in fp32, SwiGLU), plus Qwen3's
norms of each head's queries and keys (model.qk_norm, on by default), so an export to Qwen3ForCausalLM (or Llama,
with qk_norm off) is a renaming of tensors and its logits match ours (ultrathink/model/export.py).

Two optional sparse paths live in their own modules, plugged in through one interface (routing.py): `model.moe`
turns some MLPs into mixtures of experts (moe.py), `model.dre` routes only some tokens through some blocks (dre.py).
With both off (the default) this is the dense model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from ultrathink.config import ModelConfig
from ultrathink.config.schema import RopeScaling
from ultrathink.device import resolve_device
from ultrathink.hashing import file_sha256
from ultrathink.model import cpu_kernels, hf
from ultrathink.model.embedding import Embedding
from ultrathink.model.kernels import AttentionKernel
from ultrathink.model.routing import Records, RoutingModule, StepStats, numel, prefixed, variant_classes

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def weights_sha256(model_dir: str | Path) -> str:
    """The identity of a model directory's weights (ours, or a Hugging Face checkpoint's, sharded or not)."""
    model_dir = Path(model_dir)
    return hf.weights_sha256(model_dir) if hf.is_hf_checkpoint(model_dir) else file_sha256(model_dir / WEIGHTS_FILE)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """x normalised, in `dtype` (x's unless given): a caller whose consumers are matmuls under autocast asks
        for theirs (matmul_dtype), so the result is rounded once here rather than cast by each matmul it feeds."""
        dtype = dtype or x.dtype
        if cpu_kernels.rms_norm_applies(x, dtype) and cpu_kernels.computes_rms_norm(self.normalized):
            return cpu_kernels.rms_norm(x, self.weight, self.eps, dtype)
        return self.normalized(x, self.weight, self.eps, dtype)

    @staticmethod
    def normalized(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
        """The norm. In fp32 even under bf16 autocast: the mean of squares loses too much precision in bf16. torch's
        rms_norm (input and weight of one dtype) is fused on GPUs and under torch.compile; on a CPU it is several
        elementwise passes, so eager CPU runs take a fused kernel (cpu_kernels.rms_norm), only while it computes
        what this line does: edited, this line runs everywhere."""
        return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(dtype)


def matmul_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul computes in on x's device: autocast's where it is on, else x's. A norm whose output only
    feeds matmuls is asked for it: under bf16 autocast on a CPU, the three projections of the attention and the two
    of the MLP each cast an fp32 norm's output (and each cast their gradient back to add them up in fp32): 1.4-2.8% of
    the eager step at d384 × 6 (benchmarks/README.md). The gradients the matmuls return then add up in bf16."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """The rotation speed of each pair of dimensions, stretched as `scaling` says (the formulas of Hugging Face's
    rope_scaling types, so an imported model sees the positions it was trained with)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    if scaling is None:
        return inv_freq
    if scaling.type == "linear":
        return inv_freq / scaling.factor
    # llama3: wavelengths longer than the original context / low_freq_factor are slowed by `factor`, those shorter
    # than context / high_freq_factor are kept, and the band between blends the two.
    context = scaling.original_max_position_embeddings
    wavelength = 2 * math.pi / inv_freq
    slowed = torch.where(wavelength > context / scaling.low_freq_factor, inv_freq / scaling.factor, inv_freq)
    blend = (context / wavelength - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - blend) * slowed / scaling.factor + blend * slowed
    medium = (wavelength >= context / scaling.high_freq_factor) & (wavelength <= context / scaling.low_freq_factor)
    return torch.where(medium, smoothed, slowed)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for rotary position embeddings, laid out as two halves (the Llama convention)."""

    def __init__(self, head_dim: int, max_len: int, theta: float, scaling: RopeScaling | None = None):
        super().__init__()
        inv_freq = rope_frequencies(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
        angles = torch.cat([freqs, freqs], dim=-1)
        # Not persistent: derived from the config, so checkpoints need not carry them.
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        if start + length > self.cos.shape[0]:
            raise ValueError(f"position {start + length} exceeds the model's context length {self.cos.shape[0]}")
        return self.cos[start : start + length], self.sin[start : start + length]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the last dimension of x by the angles of cos/sin (broadcast against x), in x's dtype (as HF Llama
    does: its tables are cast to the activations' dtype); bf16 here is a third faster than promoting to fp32. Eager
    CPU runs of Attention.project take cpu_kernels.rotary instead (fused with the q/k norms, in fp32, rounded once),
    only while it computes what this function does: edited, this function runs everywhere."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class KVCache:
    """Keys and values of the tokens seen so far, one pair per layer; `length` is the next token's position."""

    def __init__(self, n_layers: int):
        self.layers: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * n_layers
        self.length = 0
        # Positions of the cached keys, for routed blocks (dre.py), which cache only the tokens they process.
        self.positions: list[torch.Tensor | None] = [None] * n_layers

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        past = self.layers[layer]
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        self.layers[layer] = (k, v)
        return k, v


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.dropout = cfg.dropout
        self.kernel = AttentionKernel()  # which SDPA kernel (and, on a CPU under bf16, whether fp32): kernels.py

    def forward(self, x, cos, sin, cache: KVCache | None = None, layer: int = 0, mask=None) -> torch.Tensor:
        """x (B, T, d); cos/sin (T, head_dim), or (B, T, head_dim) for tokens at their own positions. `mask`
        (boolean, True = may attend) replaces the causal mask; routed blocks pass one in generation (dre.py)."""
        B, T, _ = x.shape
        # (B, heads, T, head_dim); eager on a CPU the fused kernel stores q and k so, and attention copies neither
        q, k, v = (t.transpose(1, 2) for t in self.project(x, cos, sin))
        past = cache.length if cache is not None else 0
        if cache is not None:
            k, v = cache.update(layer, k, v)
        if mask is None and past and T > 1:  # a chunk after a cached prefix: it sees the prefix and itself, causally
            mask = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(diagonal=past)
        y = self.mix(q, k, v, mask, causal=mask is None and past == 0 and T > 1)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))

    def project(self, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (..., d) → queries (..., heads, head_dim), keys and values (..., kv_heads, head_dim), rotated to the
        positions cos/sin (..., head_dim) give. Any leading shape: routed blocks project a flat set of tokens."""
        lead = x.shape[:-1]
        q = self.q_proj(x).view(*lead, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(*lead, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(*lead, self.n_kv_heads, self.head_dim)
        if self.fuses_rotation(q, cos):  # q/k norms and rotation in one kernel
            return self.rotated(q, self.q_norm, cos, sin), self.rotated(k, self.k_norm, cos, sin), v
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # the same rotation for every head
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def fuses_rotation(self, q: torch.Tensor, cos: torch.Tensor) -> bool:
        """Whether the fused CPU kernel takes the q/k norms and rotation: it applies, and computes what the model's
        lines (apply_rotary, RMSNorm.normalized) do."""
        return (cpu_kernels.rotary_applies(q, cos) and cpu_kernels.computes_rotary(apply_rotary)
                and (self.q_norm is None or cpu_kernels.computes_rms_norm(self.q_norm.normalized)))

    @staticmethod
    def rotated(x, norm: RMSNorm | None, cos, sin) -> torch.Tensor:
        """What `apply_rotary(norm(x), ...)` computes, through the fused CPU kernel; a (B, T, heads, head_dim) result
        stored heads first, as forward's attention reads it."""
        return cpu_kernels.rotary(x, cos, sin, *(() if norm is None else (norm.weight, norm.eps)),
                                  heads_first=x.dim() == 4)

    def mix(self, q, k, v, mask=None, causal: bool = False) -> torch.Tensor:
        """Scaled dot-product attention over (B, heads, T, head_dim) queries, keys and values."""
        return self.kernel.attend(q, k, v, attn_mask=mask, is_causal=causal,
                                  dropout_p=self.dropout if self.training else 0.0,
                                  enable_gqa=self.n_kv_heads != self.n_heads)


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, hidden, bias=False)
        self.up_proj = nn.Linear(d_model, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if cpu_kernels.swiglu_applies(gate, up) and cpu_kernels.computes_swiglu(self.gated):
            return self.down_proj(cpu_kernels.swiglu(gate, up))
        return self.down_proj(self.gated(gate, up))

    @staticmethod
    def gated(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The MLP's gate. Eager on a CPU a fused kernel computes it, one pass each way (cpu_kernels.swiglu), only
        while it computes what this line does: edited (another activation), this line runs everywhere."""
        return F.silu(gate) * up


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.hidden)  # a variant may replace it (moe.py)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, cos, sin, cache: KVCache | None = None, mask=None) -> tuple[torch.Tensor, Records]:
        x = x + self.attend(x, cos, sin, cache, mask)
        fed, records = self.feed(x)
        return x + fed, records

    def attend(self, x, cos, sin, cache: KVCache | None = None, mask=None) -> torch.Tensor:
        """The attention half's contribution to the residual stream."""
        return self.drop(self.attn(self.attn_norm(x, matmul_dtype(x)), cos, sin, cache, self.layer, mask))

    def feed(self, x: torch.Tensor) -> tuple[torch.Tensor, Records]:
        """The MLP half's contribution to the residual stream, and the records of a routing MLP (MoE)."""
        # A routing MLP (MoE) adds its experts' outputs up in its input's dtype: it keeps the residual's.
        routing = isinstance(self.mlp, RoutingModule)
        out = self.mlp(self.mlp_norm(x, None if routing else matmul_dtype(x)))
        out, records = out if routing else (out, {})
        return self.drop(out), prefixed("mlp", records)


def make_block(cfg: ModelConfig, layer: int) -> nn.Module:
    """A dense block, with each enabled variant (routing.py) installed where its config section applies."""
    block = Block(cfg, layer)
    for variant in variant_classes(cfg):
        block = variant.build(cfg, layer, block)
    return block


class ModelOutput(NamedTuple):
    logits: torch.Tensor  # (B, T, vocab)
    loss: torch.Tensor | None  # what training minimises: cross-entropy, plus the aux losses in training mode
    aux_loss: torch.Tensor | None  # the routing variants' weighted aux losses (training mode), included in loss
    routing: StepStats  # each routing module's statistics of this forward, by module name


class UltraThink(nn.Module):
    def __init__(self, cfg: ModelConfig, vocab_size: int):
        super().__init__()
        self.cfg, self.vocab_size = cfg, vocab_size
        self.checkpoint_blocks = False  # gradient checkpointing: ~1/3 more compute for less activation memory
        self.embed = Embedding(vocab_size, cfg.d_model)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.seq_len, cfg.rope_theta, cfg.rope_scaling)
        self.blocks = nn.ModuleList(make_block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        # The output projection: the embedding read backwards (tied, the default), or a matrix of its own.
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, vocab_size, bias=False)
        # The routing variants (MoE layers, routed blocks, ...), found in the module tree: routing.py's interface.
        self.variants: dict[str, RoutingModule] = {
            name: m for name, m in self.named_modules() if isinstance(m, RoutingModule)}
        # A model built on the meta device holds no values (sizing counts it; from_hf assigns the checkpoint's
        # tensors): nothing to draw. There each draw runs torch's Python reference kernels: counting sizing's 95
        # candidate shapes took 15-16 s with them, 5-6.5 s without (an AVX2-only EPYC).
        if not self.embed.weight.is_meta:
            self._init_parameters()
        self._active_params = self._count_active_params()  # before any backend shards the weights

    def _init_parameters(self) -> None:
        self.apply(self._init_weights)
        # Scale the projections that write into the residual stream so its variance does not grow with depth (GPT-2).
        for name, p in self.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, std=self.cfg.init_std / math.sqrt(2 * self.cfg.n_layers))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=self.cfg.init_std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                cache: KVCache | None = None) -> ModelOutput:
        """Logits for every position and, when targets are given, the loss: in training mode the mean next-token
        loss plus the routing variants' aux losses; in eval mode the pure cross-entropy, so validation losses
        compare across architectures. Also what the routing variants did, as values (nothing is kept)."""
        start = cache.length if cache is not None else 0
        cos, sin = self.rotary(start, idx.shape[1])
        x = self.embed(idx)
        records: Records = {}
        for i, block in enumerate(self.blocks):
            if self.checkpoint_blocks and self.training:
                # Keep only each block's input; recompute its activations during backward (same RNG draws).
                x, block_records = torch.utils.checkpoint.checkpoint(block, x, cos, sin, cache, use_reentrant=False)
            else:
                x, block_records = block(x, cos, sin, cache)
            records.update(prefixed(f"blocks.{i}", block_records))
        if cache is not None:
            cache.length += idx.shape[1]
        logits = F.linear(self.norm(x, matmul_dtype(x)), self.output_weight())
        loss = aux = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
            aux = self._aux_loss(records)
            if aux is not None:
                loss = loss + aux
        return ModelOutput(logits, loss, aux, {name: r.stats for name, r in records.items()})

    def output_weight(self) -> torch.Tensor:
        """(vocab, d_model): the embedding when tied (one matrix, read in both directions), else lm_head's."""
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def use_attention(self, kernel: AttentionKernel) -> None:
        """Run every attention layer (routed blocks' included) with `kernel` (train.attention chose it)."""
        for module in self.modules():
            if isinstance(module, Attention):
                module.kernel = kernel

    def attention_kernel(self) -> AttentionKernel:
        """The kernel the attention layers run (use_attention sets it; all layers share it)."""
        return next(m.kernel for m in self.modules() if isinstance(m, Attention))

    def _aux_loss(self, records: Records) -> torch.Tensor | None:
        """Each variant's aux losses averaged over its modules (so a weight means the same at any depth), summed
        over variants; None outside training."""
        total = None
        for modules in self._by_class(records).values():
            losses = [r.aux_loss for _, r in modules.values() if r.aux_loss is not None]
            if losses:
                mean = sum(losses) / len(losses)
                total = mean if total is None else total + mean
        return total

    def _by_class(self, per_module: dict) -> dict[type, dict[str, tuple[RoutingModule, object]]]:
        groups: dict[type, dict] = {}
        for name, value in per_module.items():
            module = self.variants[name]
            groups.setdefault(type(module), {})[name] = (module, value)
        return groups

    # ---- the trainer's side of the routing interface (no-ops for the dense model) --------------------------------
    def update_routing(self, stats: StepStats) -> None:
        """After an applied optimizer step: move each variant's routing state (MoE selection biases, DRE
        thresholds) from that step's statistics, summed over micro-batches and ranks."""
        for name, module in self.variants.items():
            module.update(stats[name])

    def routing_metrics(self, stats: StepStats) -> dict[str, float]:
        """Routing health of one step (statistics summed over micro-batches and ranks), every variant's figures."""
        metrics: dict[str, float] = {}
        for cls, modules in self._by_class(stats).items():
            metrics.update(cls.metrics(modules, self))
        return metrics

    def routing_line(self, metrics: dict[str, float]) -> str:
        """The step-line suffix for routing_metrics' figures, e.g. `moe=[entropy=0.97,max_exp=14.2%]
        dre=[path=standard,kept=51.2%]`; empty for the dense model."""
        by_class: dict[type, list[RoutingModule]] = {}
        for module in self.variants.values():
            by_class.setdefault(type(module), []).append(module)
        return " ".join(filter(None, (cls.line(metrics, modules) for cls, modules in by_class.items())))

    def num_params(self) -> int:
        return sum(numel(p) for p in self.parameters())

    def _count_active_params(self) -> int:
        return self.num_params() - sum(m.idle_params() for m in self.variants.values())

    def active_params(self) -> int:
        """Parameters one token's forward uses: each MoE layer counts only top_k of its experts. (Routed blocks
        count in full: the share of tokens they process is measured, see the dre_flops_ratio metric.)"""
        return self._active_params

    def flops_per_token(self) -> int:
        """Training FLOPs per token, PaLM's convention: 6·N for the weights a token uses (the embedding counts
        once, as the output matmul: an untied embedding's lookup is no matmul) plus 12·layers·d_model·seq_len for
        attention scores and values."""
        lookup = 0 if self.lm_head is None else self.embed.weight.numel()
        return 6 * (self.active_params() - lookup) + 12 * self.cfg.n_layers * self.cfg.d_model * self.cfg.seq_len

    def save_pretrained(self, out_dir: str | Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """Write weights and config; `state_dict` lets a sharded (FSDP) run pass its gathered full weights."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in (state_dict or self.state_dict()).items()}
        save_file(state, out_dir / WEIGHTS_FILE, metadata={"format": "pt"})
        self.save_config(out_dir)

    def save_config(self, out_dir: str | Path) -> None:
        """config.json alone: what builds this model, beside weights written elsewhere (sharded checkpoints)."""
        config = {"format": "ultrathink", "vocab_size": self.vocab_size, "model": self.cfg.model_dump()}
        (Path(out_dir) / CONFIG_FILE).write_text(json.dumps(config, indent=2))

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, device: str | torch.device = "cpu",
                        dtype: torch.dtype | None = None) -> "UltraThink":
        """Load weights with safetensors (no unpickling), in eval mode, on `device` (the CPU unless told: "auto"
        is the GPU when there is one, see ultrathink.device.resolve_device; an unavailable device raises).
        `model_dir` is one of ours or a Hugging Face checkpoint of the Llama family (hf.py), whose weights keep
        the dtype they are stored in unless `dtype` says otherwise."""
        target = resolve_device(device)  # before the work: a bad device fails fast
        model_dir = Path(model_dir)
        if hf.is_hf_checkpoint(model_dir):
            return cls.from_hf(model_dir, dtype).to(target).eval()
        config = json.loads((model_dir / CONFIG_FILE).read_text())
        with torch.device("cpu"):  # built where the weights are read, whatever torch's default device, then moved
            # A config written before model.qk_norm existed describes a model without q/k norms.
            model = cls(ModelConfig(**{"qk_norm": False, **config["model"]}), config["vocab_size"])
        model.load_state_dict(load_file(model_dir / WEIGHTS_FILE, device="cpu"))
        return model.to(device=target, dtype=dtype).eval()

    @classmethod
    def from_hf(cls, model_dir: Path, dtype: torch.dtype | None = None) -> "UltraThink":
        """A Hugging Face checkpoint as an UltraThink model on the CPU. Built on the meta device, then each
        parameter is the tensor read from the checkpoint (assigned, not copied): memory holds the weights once."""
        cfg, vocab_size = hf.model_config(hf.read_config(model_dir), source=str(model_dir))
        with torch.device("meta"):
            model = cls(cfg, vocab_size)
        model.load_state_dict(hf.read_weights(model_dir, model.state_dict(), dtype), assign=True)
        model.rotary = RotaryEmbedding(cfg.head_dim, cfg.seq_len, cfg.rope_theta, cfg.rope_scaling)  # was on meta
        return model
