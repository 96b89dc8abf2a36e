import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ultrathink.config import ModelConfig, TokenizerConfig
from ultrathink.model import UltraThink
from ultrathink.model.export import ExportError, export_hf, to_hf
from ultrathink.model.generate import generate
from ultrathink.tokenizer import load_tokenizer, train_tokenizer

TEXTS = ["def f(x):\n    return x + 1", "The class statement defines a class.", "A list is a sequence."] * 20
GROUPS = {"knowledge": 2, "skill": 1, "meta": 1, "safety": 0}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(TEXTS, TokenizerConfig(vocab_size=300), out)
    return out


def saved(tmp_path, tokenizer_dir, **model) -> tuple[UltraThink, object]:
    """A random model with the tokenizer's vocabulary, saved and exported; returns it and the loaded export."""
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=64, **model)
    ours = UltraThink(cfg, len(load_tokenizer(tokenizer_dir))).eval()
    for p in ours.parameters():  # larger than the init so routing and logits differ visibly between tokens
        torch.nn.init.normal_(p, std=0.2)
    ours.save_pretrained(tmp_path / "model")
    export_hf(tmp_path / "model", tokenizer_dir, tmp_path / "hf")
    return ours, AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()


def check_parity_and_generation(ours, hf, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    ids = tokenizer("def f(x): return x", return_tensors="pt").input_ids
    with torch.no_grad():
        assert (ours(ids)[0] - hf(ids).logits).abs().max() < 1e-4
        out = hf.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert torch.equal(out, generate(ours, ids, 8, temperature=0))


@pytest.mark.parametrize("qk_norm, architecture", [(True, "Qwen3ForCausalLM"), (False, "LlamaForCausalLM")])
def test_dense_model_exports_as_qwen3_or_llama(tmp_path, tokenizer_dir, qk_norm, architecture):
    ours, hf = saved(tmp_path, tokenizer_dir, qk_norm=qk_norm)
    assert type(hf).__name__ == architecture and hf.config.tie_word_embeddings
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    check_parity_and_generation(ours, hf, tmp_path)
    assert (tmp_path / "hf" / "model.safetensors").is_file() and (tmp_path / "hf" / "tokenizer.json").is_file()


def test_moe_model_exports_as_mixtral(tmp_path, tokenizer_dir):
    ours, hf = saved(tmp_path, tokenizer_dir, qk_norm=False, moe=dict(enabled=True, every=1, top_k=2, groups=GROUPS))
    assert type(hf).__name__ == "MixtralForCausalLM"
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["num_local_experts"] == 4 and config["num_experts_per_tok"] == 2
    check_parity_and_generation(ours, hf, tmp_path)


@pytest.mark.parametrize("model, reason", [
    (dict(dre=dict(enabled=True)), "RoutedBlock: transformers has no such architecture"),
    (dict(moe=dict(enabled=True, every=2, groups=GROUPS)), "every block"),
    (dict(moe=dict(enabled=True, every=1, top_k=1, groups=GROUPS)), "top_k=1"),
    (dict(moe=dict(enabled=True, every=1, bias_balancing=True, groups=GROUPS)), "bias_balancing"),
    (dict(moe=dict(enabled=True, every=1, groups=GROUPS)), "qk_norm with MoE"),
    (dict(qkv_bias=True), "Qwen3 .q/k norms. has no q/k/v biases"),
])
def test_incompatible_models_raise_a_clear_error(model, reason):
    cfg = ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=16, **model)
    with pytest.raises(ExportError, match=reason):
        to_hf(UltraThink(cfg, 50))
