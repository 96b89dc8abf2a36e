"""Reading Hugging Face checkpoints of the Llama family: logits parity with transformers per family (fp32, ≤ 1e-4),
sharded files, and clear refusals of what the model cannot compute."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from hf_models import FAMILIES, save_family
from ultrathink.model import UltraThink
from ultrathink.model.hf import UnsupportedModelError, is_hf_checkpoint

IDS = torch.tensor([[5, 17, 42, 300, 7, 99, 1, 250, 33, 64, 2, 3]])


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tmp_path_factory):
    return request.param, save_family(request.param, tmp_path_factory.mktemp(request.param))


def reference_logits(directory, ids):
    hf = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(ids).logits


def test_logits_match_transformers(checkpoint):
    family, directory = checkpoint
    ours = UltraThink.from_pretrained(directory)
    with torch.no_grad():
        logits = ours(IDS).logits
    difference = (logits - reference_logits(directory, IDS)).abs().max().item()
    assert difference <= 1e-4, f"{family}: max |Δlogit| {difference:.2e}"
    assert logits.abs().max() > 0.1  # not a degenerate model
    cfg = ours.cfg
    assert cfg.qkv_bias == (family == "qwen2")
    assert cfg.tie_embeddings == (family == "tied")
    assert (cfg.rope_scaling is not None) == (family == "llama3_rope")


def test_a_forgotten_tensor_would_show(checkpoint):
    """The parity test can fail: zeroing any one imported norm or bias moves the logits past the tolerance."""
    family, directory = checkpoint
    ours = UltraThink.from_pretrained(directory)
    target = "blocks.1.attn.k_proj.bias" if family == "qwen2" else "blocks.1.mlp_norm.weight"
    with torch.no_grad():
        base = ours(IDS).logits
        ours.get_parameter(target).fill_(0.0 if target.endswith("bias") else 1.0)
        assert (ours(IDS).logits - base).abs().max() > 1e-3


def test_long_positions_use_the_scaled_rope(tmp_path):
    """llama3 rope scaling matters beyond its original context (32 here): parity over 100 positions."""
    directory = save_family("llama3_rope", tmp_path / "m")
    ids = torch.randint(0, 384, (1, 100), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = UltraThink.from_pretrained(directory)(ids).logits
    assert (ours - reference_logits(directory, ids)).abs().max() <= 1e-4


def test_sharded_checkpoint_loads_shard_by_shard(tmp_path):
    directory = save_family("qwen2", tmp_path / "m", max_shard_size="100KB")
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    with torch.no_grad():
        logits = UltraThink.from_pretrained(directory)(IDS).logits
    assert (logits - reference_logits(directory, IDS)).abs().max() <= 1e-4


def test_weights_keep_their_stored_dtype(tmp_path):
    directory = save_family("llama", tmp_path / "m", dtype=torch.bfloat16)
    model = UltraThink.from_pretrained(directory)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in UltraThink.from_pretrained(directory, dtype=torch.float32).parameters()} == {
        torch.float32}


def test_mistral_context_is_its_sliding_window(tmp_path):
    directory = save_family("mistral", tmp_path / "m")
    assert UltraThink.from_pretrained(directory).cfg.seq_len == 128  # sliding_window, narrower than 256


@pytest.mark.parametrize("change, named", [
    ({"model_type": "gpt2"}, "model_type 'gpt2'"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"head_dim": 32}, "head_dim 32"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope_scaling type 'yarn'"),
])
def test_unsupported_configs_are_refused_by_name(tmp_path, change, named):
    directory = save_family("llama", tmp_path / "m")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(UnsupportedModelError, match="supported: model_type llama, mistral, qwen2") as error:
        UltraThink.from_pretrained(directory)
    assert named in str(error.value)


def test_pickled_weights_are_refused(tmp_path):
    config = LlamaConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                         vocab_size=300)
    config.save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    assert is_hf_checkpoint(tmp_path)
    with pytest.raises(UnsupportedModelError, match="pytorch_model.bin would be unpickled"):
        UltraThink.from_pretrained(tmp_path)
