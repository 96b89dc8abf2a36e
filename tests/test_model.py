import contextlib
import json

import pytest
import torch
from transformers import LlamaForCausalLM, Qwen3ForCausalLM

from ultrathink.config import ModelConfig
from ultrathink.model import UltraThink, cpu_kernels
from ultrathink.model import model as model_module
from ultrathink.model.export import to_hf
from ultrathink.model.model import apply_rotary
from ultrathink.model.generate import generate, sample_next

CFG = ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=64, qk_norm=False)  # Llama's layout
VOCAB = 97


def tiny(seed=0) -> UltraThink:
    torch.manual_seed(seed)
    return UltraThink(CFG, VOCAB).eval()


def test_logits_match_hugging_face_llama():
    model = tiny()
    x = torch.randint(0, VOCAB, (2, 40))
    hf = to_hf(model)
    assert isinstance(hf, LlamaForCausalLM) and hf.config.tie_word_embeddings
    with torch.no_grad():
        assert torch.allclose(model(x)[0], hf(x).logits, atol=1e-5)


def autocast_step(model, x):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x, x)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return out.logits, grads


def same_logits_close_grads(model, x, monkeypatch):
    """One bf16 autocast step as the model runs it, and one with every norm in the residual's fp32: the logits are
    the same bits, the gradients close (they add up in bf16 where a norm feeds several matmuls)."""
    logits, grads = autocast_step(model, x)
    with monkeypatch.context() as patched:
        patched.setattr(model_module, "matmul_dtype", lambda x: x.dtype)
        fp32_logits, fp32_grads = autocast_step(model, x)
    assert torch.equal(logits, fp32_logits)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, fp32_grads[name], rtol=0.05, atol=2e-3, msg=name)


@pytest.mark.parametrize("torch_path", [False, True])
def test_norms_feeding_matmuls_return_the_autocast_dtype_and_change_no_value(monkeypatch, torch_path):
    """Under bf16 autocast the norms before the attention, the dense MLP and the output projection return bf16,
    which those matmuls would have cast them to: the logits are the same bits as with fp32 norm outputs, and the
    gradients (now added up in bf16 where a norm feeds several matmuls) stay close. A MoE MLP adds its experts'
    outputs in its input's dtype, so its norm keeps the residual's fp32. On the fused kernels and on torch's path."""
    torch.manual_seed(5)
    cfg = ModelConfig(**{**CFG.model_dump(), "qk_norm": True, "dropout": 0.0, "moe": {"enabled": True, "every": 2}})
    model = UltraThink(cfg, VOCAB).train()
    x = torch.randint(0, VOCAB, (2, 48))
    seen = {}  # the dtype each module is given (the final norm: the dtype it returns, for the output matmul)
    watched = ["blocks.0.attn.q_proj", "blocks.0.mlp", "blocks.0.mlp.gate_proj", "blocks.1.attn.q_proj",
               "blocks.1.mlp", "norm"]
    hooks = [model.get_submodule(name).register_forward_hook(
        lambda m, inp, out, name=name: seen.__setitem__(name, (out if name == "norm" else inp[0]).dtype))
        for name in watched]
    with cpu_kernels.torch_path() if torch_path else contextlib.nullcontext():
        autocast_step(model, x)
        for hook in hooks:
            hook.remove()
        same_logits_close_grads(model, x, monkeypatch)
    assert seen == {"blocks.0.attn.q_proj": torch.bfloat16, "blocks.0.mlp": torch.bfloat16,
                    "blocks.0.mlp.gate_proj": torch.bfloat16, "blocks.1.attn.q_proj": torch.bfloat16,
                    "blocks.1.mlp": torch.float32, "norm": torch.bfloat16}  # block 1's MLP is the MoE (every: 2)


def test_a_routed_block_norms_its_kept_tokens_into_the_autocast_dtype_and_changes_no_value(monkeypatch):
    """DRE's routed attention projects only the kept tokens, through its own call of the block's attention norm:
    that call returns bf16 under autocast too, with the same logits as fp32 norms and close gradients."""
    torch.manual_seed(6)
    cfg = ModelConfig(**{**CFG.model_dump(), "qk_norm": True, "dropout": 0.0,
                         "dre": {"enabled": True, "every": 2, "warmup_steps": 0}})
    model = UltraThink(cfg, VOCAB).train()
    x = torch.randint(0, VOCAB, (2, 48))
    seen = {}
    routed_norm = model.blocks[1].block.attn_norm
    hook = routed_norm.register_forward_hook(lambda m, inp, out: seen.update(shape=inp[0].shape, dtype=out.dtype))
    autocast_step(model, x)
    hook.remove()
    # a flat set of the kept tokens (padded to a multiple of rows), not the whole batch
    assert seen["dtype"] == torch.bfloat16 and len(seen["shape"]) == 2 and seen["shape"][0] < x.numel()
    same_logits_close_grads(model, x, monkeypatch)


def test_qk_norm_normalises_each_head_and_matches_qwen3():
    """model.qk_norm: RMSNorm over each head's queries and keys before RoPE, as Qwen3 computes (export parity)."""
    torch.manual_seed(0)
    model = UltraThink(CFG.model_copy(update={"qk_norm": True}), VOCAB).eval()
    with torch.no_grad():
        for norm in (model.blocks[0].attn.q_norm, model.blocks[1].attn.k_norm):
            norm.weight.copy_(1 + 0.3 * torch.randn(norm.weight.shape))  # away from 1: a skipped norm would show
    attn, x = model.blocks[0].attn, torch.randn(2, 5, CFG.d_model)
    cos, sin = model.rotary(0, 5)
    q, k, _ = attn.project(x, cos, sin)
    raw_q = attn.q_proj(x).view(2, 5, CFG.n_heads, CFG.head_dim)
    expected = raw_q * torch.rsqrt(raw_q.pow(2).mean(-1, keepdim=True) + CFG.norm_eps) * attn.q_norm.weight
    assert torch.allclose(q, apply_rotary(expected, cos.unsqueeze(-2), sin.unsqueeze(-2)), atol=1e-5)
    hf = to_hf(model)
    assert isinstance(hf, Qwen3ForCausalLM)
    ids = torch.randint(0, VOCAB, (2, 40))
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, hf(ids).logits, atol=1e-5)
    plain = UltraThink(CFG, VOCAB).eval()
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if "_norm" not in k or "attn." not in k})
    with torch.no_grad():
        assert (plain(ids).logits - model(ids).logits).abs().max() > 1e-3


def test_a_model_saved_before_qk_norm_existed_loads_as_it_was_trained(tmp_path):
    """A config.json written before model.qk_norm (a registered champion, a user's model dir) has no such key: it is
    a model without q/k norms, though they are on by default now."""
    model = tiny()
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["model"]["qk_norm"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert ModelConfig(**config["model"]).qk_norm  # the default would build the other architecture
    loaded = UltraThink.from_pretrained(tmp_path)
    ids = torch.randint(0, VOCAB, (2, 20))
    with torch.no_grad():
        assert not loaded.cfg.qk_norm and torch.equal(loaded(ids).logits, model(ids).logits)


def test_causal_later_tokens_do_not_change_earlier_logits():
    model = tiny()
    x = torch.randint(0, VOCAB, (1, 30))
    y = x.clone()
    y[0, 20:] = (y[0, 20:] + 1) % VOCAB
    with torch.no_grad():
        a, b = model(x)[0], model(y)[0]
    assert torch.equal(a[:, :20], b[:, :20])
    assert not torch.allclose(a[:, 20:], b[:, 20:])


def test_greedy_with_and_without_cache_identical_for_a_batch():
    model = tiny()
    x = torch.randint(0, VOCAB, (3, 7))
    with_cache = generate(model, x, 25, temperature=0, use_cache=True)
    without = generate(model, x, 25, temperature=0, use_cache=False)
    assert with_cache.shape == (3, 32) and torch.equal(with_cache, without)


def test_generation_stops_at_eos_and_respects_context():
    model = tiny()
    x = torch.randint(0, VOCAB, (1, 5))
    first = generate(model, x, 1, temperature=0)[0, -1].item()
    out = generate(model, x, 20, temperature=0, eos_id=first)
    assert out.shape[1] == 6  # stopped right after emitting "eos"
    assert generate(model, torch.randint(0, VOCAB, (1, 60)), 100, temperature=0).shape[1] == CFG.seq_len


def test_top_k_one_is_greedy_and_seed_is_reproducible():
    logits = torch.randn(4, VOCAB)
    g = torch.Generator().manual_seed(0)
    assert torch.equal(sample_next(logits, 1.0, 1, None, g), logits.argmax(-1, keepdim=True))
    a = sample_next(logits, 1.0, None, 0.9, torch.Generator().manual_seed(5))
    b = sample_next(logits, 1.0, None, 0.9, torch.Generator().manual_seed(5))
    assert torch.equal(a, b)


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.05, 0.05]]))
    draws = {sample_next(logits, 1.0, None, 0.8, torch.Generator().manual_seed(s)).item() for s in range(200)}
    assert draws == {0, 1}


def test_save_and_load_round_trip(tmp_path):
    model = tiny()
    model.save_pretrained(tmp_path)
    loaded = UltraThink.from_pretrained(tmp_path)
    x = torch.randint(0, VOCAB, (1, 16))
    with torch.no_grad():
        assert torch.equal(model(x)[0], loaded(x)[0])


@pytest.mark.parametrize("qk_norm", [False, True])
def test_loss_is_cross_entropy_and_gradients_reach_every_parameter(qk_norm):
    torch.manual_seed(0)
    model = UltraThink(CFG.model_copy(update={"qk_norm": qk_norm}), VOCAB).train()
    x, y = torch.randint(0, VOCAB, (2, 16)), torch.randint(0, VOCAB, (2, 16))
    logits, loss = model(x, y)[:2]
    assert torch.isclose(loss, torch.nn.functional.cross_entropy(logits.view(-1, VOCAB), y.view(-1)))
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_a_model_on_the_meta_device_draws_no_weights_and_counts_as_one_on_the_cpu(monkeypatch):
    """The meta device holds no values, so the init's draws are skipped there (sizing builds every candidate shape
    on it: they were two thirds of its time); a model on the CPU still draws every Linear and Embedding, and both
    count the same parameters and FLOPs, which is what sizing reads."""
    drawn = []
    real_init = UltraThink._init_weights
    monkeypatch.setattr(UltraThink, "_init_weights", lambda self, module: drawn.append(module) or real_init(self, module))
    with torch.device("meta"):
        on_meta = UltraThink(CFG, VOCAB)
    assert drawn == [] and on_meta.embed.weight.is_meta
    torch.manual_seed(0)
    on_cpu = UltraThink(CFG, VOCAB)
    assert sum(isinstance(m, (torch.nn.Linear, torch.nn.Embedding)) for m in drawn) == 1 + 7 * CFG.n_layers
    # Drawn from the seed alone: tiny(0) builds the same weights.
    assert all(torch.equal(a, b) for a, b in zip(on_cpu.state_dict().values(), tiny(0).state_dict().values()))
    assert on_cpu.embed.weight.std().item() == pytest.approx(CFG.init_std, rel=0.1)
    assert (on_meta.num_params(), on_meta.flops_per_token()) == (on_cpu.num_params(), on_cpu.flops_per_token())


def test_under_compile_on_a_cpu_the_embeddings_gradient_is_atens_kernel_with_eagers_values():
    """torch.compile's backward calls the opaque ultrathink::embedding_backward (ATen's kernel; Inductor would
    write an atomic add per element: ultrathink/model/embedding.py) and every gradient, the tied table's included
    (the lookup's and the output projection's summed), is what eager computes. Repeated tokens sum into one row."""
    from torch.profiler import ProfilerActivity, profile

    model = tiny()
    idx = torch.randint(0, VOCAB, (3, 16))
    idx[0, :6] = 5
    model(idx, idx).loss.backward()
    eager = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    try:
        with profile(activities=[ProfilerActivity.CPU]) as traced:
            compiled(idx, idx).loss.backward()
    finally:
        torch._dynamo.reset()
    calls = {event.key for event in traced.key_averages()}
    assert "ultrathink::embedding_backward" in calls
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, eager[name], rtol=1e-5, atol=1e-7, msg=name)
    assert eager["embed.weight"][5].abs().sum() > 0
