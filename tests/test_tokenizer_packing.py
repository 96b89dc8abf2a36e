"""Byte-level BPE tokenizer and packed token files: lossless, loadable, deterministic, correctly counted."""

import json

import numpy as np
import pytest
from transformers import AutoTokenizer

from ultrathink.config import PrepareConfig, TokenizerConfig
from ultrathink.data.packing import prepare_splits, split_fraction
from ultrathink.data.tokens import load_split, read_meta
from ultrathink.data.sources import embedded_paragraphs
from ultrathink.tokenizer import EOS_TOKEN, PAD_TOKEN, load_tokenizer, train_tokenizer

VOCAB = 600
UNICODE_SAMPLES = [
    "Ünïcödé àccents, ñ, ß, œ",
    "emoji 🤗🚀 and a family 👨‍👩‍👧 (ZWJ sequence)",
    "中文，日本語のテキスト، العربية",
    "  leading spaces, trailing tabs\t\t\r\nwindows line end",
    "control \x00\x07 chars and a BOM \ufeff",
    f"a literal {EOS_TOKEN} and {PAD_TOKEN} in the text",
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    train_tokenizer(iter(embedded_paragraphs()), TokenizerConfig(vocab_size=VOCAB, min_frequency=2), out)
    return out


@pytest.fixture(scope="module")
def docs():
    """Real paragraphs plus unicode samples and one repeated document."""
    paragraphs = embedded_paragraphs()[:150]
    return paragraphs + UNICODE_SAMPLES + [paragraphs[3]]


def write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def test_round_trip_is_lossless_for_any_unicode(tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    for text in UNICODE_SAMPLES:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
    assert tok.eos_token_id not in tok(UNICODE_SAMPLES[-1], add_special_tokens=False)["input_ids"]


def test_auto_tokenizer_loads_the_saved_dir(tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    assert (tok.eos_token, tok.bos_token, tok.pad_token) == (EOS_TOKEN, EOS_TOKEN, PAD_TOKEN)
    assert (tok.eos_token_id, tok.pad_token_id) == (0, 1)
    assert len(tok) == VOCAB
    assert tok.model_max_length >= 2**40
    assert tok("x = 1", add_special_tokens=True)["input_ids"] == tok("x = 1", add_special_tokens=False)["input_ids"]


def test_training_replaces_the_output_dir(tmp_path):
    out = tmp_path / "tok"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    train_tokenizer(["some text " * 20, "more text " * 20], TokenizerConfig(vocab_size=300), out)
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["tok"]  # no temp dirs left behind


def test_load_tokenizer_names_a_missing_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer at .*missing"):
        load_tokenizer(tmp_path / "missing")


def split_docs(tokens: np.ndarray, eos_id: int, tok) -> list[str]:
    """Decode a packed file back into its documents, using EOS as the separator."""
    tokens = np.asarray(tokens)
    ends = np.flatnonzero(tokens == eos_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tok.decode(tokens[s:e].tolist()) for s, e in zip(starts, ends)]


@pytest.mark.spawns
def test_packing_counts_splits_and_separates_documents(tmp_path, tokenizer_dir, docs):
    corpus = write_jsonl(tmp_path / "corpus.jsonl", docs)
    meta = prepare_splits(corpus, tokenizer_dir, PrepareConfig(val_fraction=0.2, batch_size=7), tmp_path / "prep")
    tok = load_tokenizer(tokenizer_dir)

    expected_val = [d for d in docs if split_fraction(d) < 0.2]
    expected_train = [d for d in docs if split_fraction(d) >= 0.2]
    assert expected_val and expected_train and meta["moved_last_document_to"] is None
    assert meta == read_meta(tmp_path / "prep")
    assert (meta["dtype"], meta["vocab_size"], meta["eos_id"]) == ("uint16", VOCAB, tok.eos_token_id)

    for split, expected in (("train", expected_train), ("val", expected_val)):
        tokens = load_split(tmp_path / "prep", split)
        assert tokens.dtype == np.uint16 and tokens[:5].dtype == np.uint16
        n_tokens = sum(len(tok(d, add_special_tokens=False)["input_ids"]) + 1 for d in expected)
        assert meta[split] == {
            "tokens": n_tokens, "documents": len(expected), "bytes": sum(len(d.encode("utf-8")) for d in expected),
            "shards": [{"file": f"{split}-00000.bin", "tokens": n_tokens}]}
        assert len(tokens) == n_tokens and tokens[-1] == tok.eos_token_id
        assert split_docs(tokens, tok.eos_token_id, tok) == expected  # one EOS after each document, in order

    assert not set(expected_train) & set(expected_val)  # a repeated document stays in one split
    assert sorted(expected_train + expected_val) == sorted(docs)


@pytest.mark.spawns
def test_packing_is_deterministic_and_replaces_output(tmp_path, tokenizer_dir, docs):
    corpus = write_jsonl(tmp_path / "corpus.jsonl", docs)
    cfg = PrepareConfig(val_fraction=0.2, batch_size=50)
    first = prepare_splits(corpus, tokenizer_dir, cfg, tmp_path / "a")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "stale.bin").write_bytes(b"old")
    second = prepare_splits(corpus, tokenizer_dir, PrepareConfig(val_fraction=0.2, batch_size=3), tmp_path / "b")
    assert first == second
    for name in ("train-00000.bin", "val-00000.bin", "meta.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["meta.json", "train-00000.bin", "val-00000.bin", "val.jsonl"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "corpus.jsonl"]


@pytest.mark.spawns
def test_tiny_corpus_moves_last_document_to_val(tmp_path, tokenizer_dir):
    texts = ["first document", "second document", "third document"]
    assert all(split_fraction(t) >= 0.01 for t in texts)  # hashing alone would leave val empty
    corpus = write_jsonl(tmp_path / "c.jsonl", texts)
    meta = prepare_splits(corpus, tokenizer_dir, PrepareConfig(val_fraction=0.01), tmp_path / "prep")
    assert meta["moved_last_document_to"] == "val"
    assert (meta["train"]["documents"], meta["val"]["documents"]) == (2, 1)
    assert meta["val"]["bytes"] == len("third document")


def test_packing_rejects_bad_input_naming_file_and_line(tmp_path, tokenizer_dir):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "a"}\n\n{"text": null}\n')
    with pytest.raises(ValueError, match=r"c\.jsonl:3: 'text' must be a string, got null"):
        prepare_splits(corpus, tokenizer_dir, PrepareConfig(), tmp_path / "prep")
    write_jsonl(corpus, ["only one"])
    with pytest.raises(ValueError, match="1 document\\(s\\); train and val need at least one each"):
        prepare_splits(corpus, tokenizer_dir, PrepareConfig(), tmp_path / "prep")
    assert not (tmp_path / "prep").exists()


def test_load_split_rejects_unknown_split(tmp_path):
    with pytest.raises(ValueError, match="unknown split 'test'; expected one of train, val"):
        load_split(tmp_path, "test")
