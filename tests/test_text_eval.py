"""The one yardstick: `ultrathink eval` and the evaluate stage score documents with the same function; a text file
is split into documents as the data loader splits it."""

import math

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from ultrathink.cli import app
from ultrathink.config import ModelConfig, TokenizerConfig
from ultrathink.model import UltraThink
from ultrathink.data.sources import split_documents
from ultrathink.evaluate import Yardstick, encode_documents, score_documents
from ultrathink.registry.models import ModelNotFoundError, resolve_model
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
    docs = [TEXT, "A second document, shorter."]
    ids = [tok(d, add_special_tokens=False)["input_ids"] for d in docs]
    eos = tok.eos_token_id
    tokens = torch.tensor([eos, *ids[0], eos, *ids[1], eos])  # packed as prepare packs: EOS after each document
    assert torch.equal(encode_documents(tok, docs), tokens) and len(tokens) > 17  # several windows, one ragged
    total = 0.0
    with torch.no_grad():
        for start in range(0, len(tokens) - 1, 16):  # each window sees only its own context, as the scorer does
            window = tokens[start : start + 17]
            logits = model(window[None, :-1]).logits
            total += F.cross_entropy(logits[0], window[1:], reduction="sum").item()
    score = score_documents(model, tok, docs)
    n_bytes = sum(len(d.encode("utf-8")) for d in docs)
    assert score.tokens == len(tokens) - 1 and score.bytes == n_bytes and score.documents == 2
    assert score.loss == pytest.approx(total / score.tokens, rel=1e-5)
    assert score.bits_per_byte == pytest.approx(total / (math.log(2) * n_bytes), rel=1e-5)
    assert score.perplexity == pytest.approx(math.exp(score.loss))


@pytest.mark.parametrize("unit, expected", [
    ("paragraph", ["= Title =", "line one\nline two", "last"]),
    ("line", ["= Title =", "line one", "line two", "last"]),
    ("file", ["= Title = \n\nline one\nline two\n \n\nlast"]),
])
def test_text_units_split_as_the_loader_splits(unit, expected):
    text = " = Title = \n\nline one\nline two\n \n\nlast\n"
    assert split_documents(text, unit) == expected


def test_separators_are_not_scored(artifacts, tmp_path):
    """Blank lines between paragraphs are not text of any document: eval of a file equals the score of its
    documents, and the same documents written with other separators score the same."""
    docs = ["First paragraph here.", "Second one, a little longer than the first.", "Third."]
    model, tok = UltraThink.from_pretrained(artifacts / "model"), load_tokenizer(artifacts / "tokenizer")
    expected = score_documents(model, tok, docs)
    for unit, text in (("paragraph", "\n\n\n".join(docs)), ("line", "\n".join(docs) + "\n")):
        (tmp_path / f"{unit}.txt").write_text(text, encoding="utf-8")
        result = CliRunner().invoke(app, ["eval", "--model", str(artifacts / "model"), "--text-file",
                                          str(tmp_path / f"{unit}.txt"), "-S", f"data.txt_unit={unit}",
                                          "--params", str(tmp_path / "absent.yaml")])
        assert result.exit_code == 2 and "params file not found" in result.output  # a named params file must exist
        result = CliRunner().invoke(app, ["eval", "--model", str(artifacts / "model"), "--text-file",
                                          str(tmp_path / f"{unit}.txt"), "-S", f"data.txt_unit={unit}"])
        assert result.exit_code == 0, result.output
        assert f"bits/byte {expected.bits_per_byte:.4f}" in result.output and "3 documents" in result.output


def test_yardstick_names_its_text():
    a, b = Yardstick(("one", "two")), Yardstick(("one", "two "))
    assert a.sha256 != b.sha256 and a.bytes == 6 and a.describe()["documents"] == 2
    assert a.sha256 == Yardstick(("one", "two")).sha256


def test_model_layouts_and_a_wrong_path(artifacts, tmp_path):
    expected = (artifacts / "model", artifacts / "tokenizer")
    assert resolve_model(str(artifacts / "model")) == expected  # artifacts/model with a sibling tokenizer/
    assert resolve_model(str(artifacts)) == expected  # a dir holding model/ and tokenizer/ (the pyfunc layout)
    with pytest.raises(ModelNotFoundError, match=r"nowhere: not a model: expected a model dir"):
        resolve_model(str(tmp_path / "nowhere"))


def test_cli_prints_loss_and_bits_per_byte(artifacts, tmp_path):
    text_file = tmp_path / "t.txt"
    text_file.write_text(TEXT, encoding="utf-8")
    expected = score_documents(UltraThink.from_pretrained(artifacts / "model"), load_tokenizer(artifacts / "tokenizer"),
                               [TEXT.strip()])
    result = CliRunner().invoke(app, ["eval", "--model", str(artifacts / "model"), "--text-file", str(text_file)])
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"loss {expected.loss:.4f} nats/token  bits/byte {expected.bits_per_byte:.4f}")
    missing = CliRunner().invoke(app, ["eval", "--model", str(artifacts), "--text-file", str(tmp_path / "no.txt")])
    assert missing.exit_code == 1 and "text file not found" in missing.output
