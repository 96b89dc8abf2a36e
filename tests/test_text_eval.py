"""`ultrathink eval`: loss and bits per byte of a text under a model and its own tokenizer, from a model dir."""

import math

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from ultrathink.cli import app
from ultrathink.config import ModelConfig, TokenizerConfig
from ultrathink.model import UltraThink
from ultrathink.text_eval import ModelNotFoundError, resolve_model, score_text
from ultrathink.tokenizer import load_tokenizer, train_tokenizer

TEXT = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer. " * 3


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    root = tmp_path_factory.mktemp("artifacts")
    train_tokenizer([TEXT] * 5, TokenizerConfig(vocab_size=300), root / "tokenizer")
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, seq_len=16, dropout=0.0)
    UltraThink(cfg, len(load_tokenizer(root / "tokenizer"))).save_pretrained(root / "model")
    return root


def test_score_matches_a_direct_cross_entropy(artifacts):
    model, tok = UltraThink.from_pretrained(artifacts / "model"), load_tokenizer(artifacts / "tokenizer")
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    assert len(ids) > 16  # several windows, the last one ragged
    tokens = torch.tensor([tok.eos_token_id, *ids])
    total = 0.0
    with torch.no_grad():
        for start in range(0, len(ids), 16):  # each window sees only its own context, as the scorer does
            window = tokens[start : start + 17]
            logits, _ = model(window[None, :-1])
            total += F.cross_entropy(logits[0], window[1:], reduction="sum").item()
    score = score_text(model, tok, TEXT)
    assert score.tokens == len(ids) and score.bytes == len(TEXT.encode("utf-8"))
    assert score.loss == pytest.approx(total / len(ids), rel=1e-5)
    assert score.bits_per_byte == pytest.approx(total / (math.log(2) * score.bytes), rel=1e-5)
    assert score.perplexity == pytest.approx(math.exp(score.loss))


def test_model_layouts_and_a_wrong_path(artifacts, tmp_path):
    expected = (artifacts / "model", artifacts / "tokenizer")
    assert resolve_model(str(artifacts / "model")) == expected  # artifacts/model with a sibling tokenizer/
    assert resolve_model(str(artifacts)) == expected  # a dir holding model/ and tokenizer/ (the pyfunc layout)
    with pytest.raises(ModelNotFoundError, match=r"nowhere: not a model: expected a model dir"):
        resolve_model(str(tmp_path / "nowhere"))


def test_cli_prints_loss_and_bits_per_byte(artifacts, tmp_path):
    text_file = tmp_path / "t.txt"
    text_file.write_text(TEXT, encoding="utf-8")
    expected = score_text(UltraThink.from_pretrained(artifacts / "model"), load_tokenizer(artifacts / "tokenizer"), TEXT)
    result = CliRunner().invoke(app, ["eval", "--model", str(artifacts / "model"), "--text-file", str(text_file)])
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"loss {expected.loss:.4f} nats/token  bits/byte {expected.bits_per_byte:.4f}")
    missing = CliRunner().invoke(app, ["eval", "--model", str(artifacts), "--text-file", str(tmp_path / "no.txt")])
    assert missing.exit_code == 1 and "text file not found" in missing.output
