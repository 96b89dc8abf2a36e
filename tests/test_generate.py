"""`ultrathink generate`: streamed text, prompts longer than the context, top_p everywhere generation happens."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ultrathink.config import ModelConfig, TokenizerConfig
from ultrathink.model import UltraThink
from ultrathink.model.generate import crop_prompt, generate, generate_text, stream_text
from ultrathink.registry.pyfunc_model import UltraThinkModel
from ultrathink.tokenizer import load_tokenizer, train_tokenizer

ROOT = Path(__file__).resolve().parents[1]
TEXT = [f"The cat number {i} sat on the mat and looked at the dog, which barked {i % 7} times." for i in range(400)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A pipeline-style layout: artifacts/model beside artifacts/tokenizer, a tiny model trained on nothing."""
    root = tmp_path_factory.mktemp("gen") / "artifacts"
    train_tokenizer(TEXT, TokenizerConfig(vocab_size=320), root / "tokenizer")
    torch.manual_seed(0)
    model = UltraThink(ModelConfig(d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, seq_len=32, dropout=0.0),
                       len(load_tokenizer(root / "tokenizer")))
    model.save_pretrained(root / "model")
    return root / "model"


def loaded(model_dir: Path):
    return UltraThink.from_pretrained(model_dir), load_tokenizer(model_dir.parent / "tokenizer")


def test_a_prompt_longer_than_the_context_is_cropped_to_its_last_tokens(model_dir):
    model, tokenizer = loaded(model_dir)
    prompt = " ".join(TEXT[:10])  # far more than 32 tokens
    ids = torch.tensor([tokenizer.encode(prompt)])
    assert ids.shape[1] > 3 * model.cfg.seq_len
    kept = crop_prompt(ids, model.cfg.seq_len, 8)
    assert torch.equal(kept, ids[:, -24:])  # room for the 8 new tokens
    assert torch.equal(crop_prompt(ids, 32, 100), ids[:, -16:])  # at most half the context for new tokens
    out = generate(model, ids, 8, temperature=0)
    assert torch.equal(out[:, :24], ids[:, -24:]) and out.shape[1] == 32
    text = generate_text(model, tokenizer, prompt, 8, 0.0, None, 0)
    assert text  # not the empty answer of a prompt that left no room
    assert text == tokenizer.decode(out[0, 24:].tolist())


def test_streamed_pieces_join_to_the_whole_text(model_dir):
    model, tokenizer = loaded(model_dir)
    pieces = list(stream_text(model, tokenizer, "The cat", 20, 1.0, None, seed=3, top_p=0.9))
    assert len(pieces) > 1 and all(pieces)
    ids = torch.tensor([tokenizer.encode("The cat")])
    out = generate(model, ids, 20, 1.0, None, 0.9, tokenizer.eos_token_id, seed=3)
    new = [t for t in out[0, ids.shape[1]:].tolist() if t != tokenizer.eos_token_id]
    assert "".join(pieces) == tokenizer.decode(new)


def test_the_registered_model_takes_top_p_from_params_over_its_defaults():
    wrapper = UltraThinkModel()
    wrapper.defaults = {"max_new_tokens": 8, "temperature": 0.8, "top_k": 50, "top_p": 0.95, "seed": 0}
    assert wrapper.generation_knobs(None)["top_p"] == 0.95
    assert wrapper.generation_knobs({"top_p": 0.5})["top_p"] == 0.5
    wrapper.defaults.pop("top_p")  # a model registered before top_p existed
    assert wrapper.generation_knobs(None)["top_p"] is None


def ultrathink(*args: str) -> subprocess.CompletedProcess:
    command = Path(sys.executable).parent / "ultrathink"  # the console script pip installed
    return subprocess.run([str(command), *args], cwd=ROOT, capture_output=True, text=True)


@pytest.mark.spawns
def test_generate_command_prints_what_generate_text_computes(model_dir):
    model, tokenizer = loaded(model_dir)
    done = ultrathink("generate", "--model", str(model_dir), "--prompt", "The cat", "--temperature", "0",
                      "--max-new-tokens", "12")
    assert done.returncode == 0, done.stderr
    assert done.stdout == generate_text(model, tokenizer, "The cat", 12, 0.0, None, 0) + "\n"
    sampled = ultrathink("generate", "--model", str(model_dir), "--prompt", "The cat", "--top-p", "0.5",
                         "--seed", "7", "--max-new-tokens", "12")
    assert sampled.stdout == generate_text(model, tokenizer, "The cat", 12, 0.8, 50, 7, 0.5) + "\n"


@pytest.mark.spawns
def test_generate_command_names_a_bad_flag_and_a_missing_model(model_dir, tmp_path):
    bad = ultrathink("generate", "--model", str(model_dir), "--prompt", "x", "--top-p", "1.5")
    assert bad.returncode == 2 and "--top-p" in bad.stderr
    missing = ultrathink("generate", "--model", str(tmp_path / "nothing"), "--prompt", "x")
    assert missing.returncode == 1 and "not a model" in " ".join(missing.stderr.split())  # rich wraps lines
