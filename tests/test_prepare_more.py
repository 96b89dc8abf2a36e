"""prepare beyond the basics: streaming sources give the same token files, the tail split, chunked encoding of long
documents, process-pool tokenization, and the token-level checks with their report."""

import json

import numpy as np
import pytest

from ultrathink.config import DataConfig, PrepareConfig, TokenizerConfig
from ultrathink.data.packing import _pieces, prepare_splits, training_texts, val_documents
from ultrathink.data.tokens import load_split
from ultrathink.data.sources import load_corpus
from ultrathink.data.token_checks import TokenCheckError, check_token_files
from ultrathink.evaluate import encode_documents
from ultrathink.tokenizer import load_tokenizer, tokenizer_hash, train_tokenizer

# A play-like script (speaker lines, blank-line paragraphs), written for this test.
SCRIPT = "Keeper:\nThe lamps are lit along the northern wall.\n\nApprentice:\nThen read, read.\n\n" * 3
DOCS = [f"Document {i}: {'lorem ipsum dolor ' * (i % 5 + 1)}end {i}." for i in range(60)]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    train_tokenizer(DOCS + [SCRIPT], TokenizerConfig(vocab_size=320), out)
    return out


def write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def test_streaming_and_eager_sources_give_identical_token_files(tmp_path, tokenizer_dir):
    write_jsonl(tmp_path / "raw.jsonl", DOCS)
    outputs = []
    for streaming in (False, True):
        texts = load_corpus(DataConfig(source="raw.jsonl", streaming=streaming), root=tmp_path)["text"].tolist()
        corpus = write_jsonl(tmp_path / f"corpus-{streaming}.jsonl", texts)
        out = tmp_path / f"prep-{streaming}"
        prepare_splits(corpus, tokenizer_dir, PrepareConfig(val_fraction=0.2, workers=1), out)
        outputs.append({name: (out / name).read_bytes() for name in ("train-00000.bin", "val-00000.bin", "meta.json")})
    assert outputs[0] == outputs[1]


@pytest.mark.spawns
def test_process_pool_output_equals_in_process(tmp_path, tokenizer_dir):
    corpus = write_jsonl(tmp_path / "c.jsonl", DOCS)
    one = prepare_splits(corpus, tokenizer_dir, PrepareConfig(val_fraction=0.2, batch_size=7, workers=1), tmp_path / "a")
    two = prepare_splits(corpus, tokenizer_dir, PrepareConfig(val_fraction=0.2, batch_size=7, workers=2), tmp_path / "b")
    assert one == two
    for name in ("train-00000.bin", "val-00000.bin"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_tail_split_puts_the_end_of_a_single_document_in_val(tmp_path, tokenizer_dir):
    text = "".join(f"line number {i:03d}\n" for i in range(100))  # 1,600 characters, 16 per line
    corpus = write_jsonl(tmp_path / "c.jsonl", [text])
    cfg = PrepareConfig(split="tail", val_fraction=0.1, workers=1)
    meta = prepare_splits(corpus, tokenizer_dir, cfg, tmp_path / "prep", report_dir=tmp_path / "report")
    # 90% of 1,600 = 1,440 characters: exactly the start of line 90.
    assert (meta["split"], meta["cut_document"], meta["cut_offset"]) == ("tail", 0, 1440)
    tok = load_tokenizer(tokenizer_dir)
    train, val = load_split(tmp_path / "prep", "train"), load_split(tmp_path / "prep", "val")
    assert tok.decode(train[:-1].tolist()) == text[:1440] and tok.decode(val[:-1].tolist()) == text[1440:]
    assert (meta["train"]["documents"], meta["val"]["documents"]) == (1, 1)
    assert (meta["train"]["bytes"], meta["val"]["bytes"]) == (1440, 160)
    assert list(training_texts(corpus, cfg)) == [text[:1440]]
    assert json.loads((tmp_path / "report" / "token_report.json").read_text())["success"] is True


def test_tail_split_over_several_documents_cuts_inside_one_at_a_line_start(tmp_path, tokenizer_dir):
    docs = ["a" * 50, "b" * 10 + "\n" + "c" * 39, "d" * 50]  # 150 characters; train gets 75
    meta = prepare_splits(write_jsonl(tmp_path / "c.jsonl", docs), tokenizer_dir,
                          PrepareConfig(split="tail", val_fraction=0.5, workers=1), tmp_path / "prep")
    assert (meta["cut_document"], meta["cut_offset"]) == (1, 11)  # the line start before character 25 of doc 1
    assert meta["train"]["bytes"] == 61 and meta["val"]["bytes"] == 89
    assert (meta["train"]["documents"], meta["val"]["documents"]) == (2, 2)


def test_tail_cut_at_a_document_boundary_puts_no_empty_document_in_val(tmp_path, tokenizer_dir):
    docs = ["a" * 45, "b" * 5, "c" * 50]  # 100 characters, train gets exactly 50: the end of document 1
    meta = prepare_splits(write_jsonl(tmp_path / "c.jsonl", docs), tokenizer_dir,
                          PrepareConfig(split="tail", val_fraction=0.5, workers=1), tmp_path / "prep",
                          report_dir=tmp_path / "report")
    assert (meta["cut_document"], meta["cut_offset"]) == (2, 0)  # the whole of document 2 is val
    assert (meta["train"]["documents"], meta["val"]["documents"]) == (2, 1)
    assert val_documents(tmp_path / "prep") == ["c" * 50]


@pytest.mark.spawns
def test_val_text_holds_exactly_what_val_bin_encodes(tmp_path, tokenizer_dir):
    """val.jsonl is the evaluation text: encoded as evaluation encodes it, it gives val.bin's tokens."""
    corpus = write_jsonl(tmp_path / "c.jsonl", DOCS + [SCRIPT * 40])
    meta = prepare_splits(corpus, tokenizer_dir, PrepareConfig(val_fraction=0.3, batch_size=7, workers=2),
                          tmp_path / "prep")
    docs = val_documents(tmp_path / "prep")
    assert len(docs) == meta["val"]["documents"] and sum(len(d.encode()) for d in docs) == meta["val"]["bytes"]
    stream = encode_documents(load_tokenizer(tokenizer_dir), docs)
    assert stream[1:].tolist() == load_split(tmp_path / "prep", "val")[:].tolist()
    assert meta["tokenizer_sha256"] == tokenizer_hash(tokenizer_dir)
    first_two = val_documents(tmp_path / "prep", max_bytes=len(docs[0].encode()) + len(docs[1].encode()))
    assert first_two == docs[:2] and val_documents(tmp_path / "prep", max_bytes=1) == docs[:1]


def test_long_documents_are_encoded_in_pieces_with_the_same_ids(tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    text = SCRIPT + "  indented line\n\n\nlast"
    pieces = _pieces(text, 40)
    assert len(pieces) > 3 and "".join(pieces) == text
    assert all(p.endswith("\n") and not q[0].isspace() for p, q in zip(pieces, pieces[1:]))  # cut at line starts
    whole = tok(text, add_special_tokens=False)["input_ids"]
    assert sum((tok(p, add_special_tokens=False)["input_ids"] for p in pieces), []) == whole
    assert _pieces("x" * 100, 10) == ["x" * 100]  # no line start to cut at: stays whole


def write_split(prep, name, *shards):
    """Token files of one split, one per list of ids; their entry in meta.json."""
    for number, ids in enumerate(shards):
        np.array(ids, dtype=np.uint16).tofile(prep / f"{name}-{number:05d}.bin")
    return {"tokens": sum(map(len, shards)),
            "shards": [{"file": f"{name}-{n:05d}.bin", "tokens": len(ids)} for n, ids in enumerate(shards)]}


def test_token_checks_name_each_failure_and_write_the_report(tmp_path, tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    prep, report_dir = tmp_path / "prep", tmp_path / "report"
    prep.mkdir()
    doc = tok("Document 1", add_special_tokens=False)["input_ids"]
    # an empty document, a shared one, an id ≥ vocab; a shard that ends inside a document
    train = write_split(prep, "train", [5, 6, 0, 0, 9], [9, 0, *doc, 0, 999, 0])
    val = write_split(prep, "val", [*doc, 0, 7])  # a shared document, no final EOS
    meta = {"dtype": "uint16", "vocab_size": 320, "eos_id": 0,
            "train": {"documents": 5, **train}, "val": {"documents": 1, **val}}
    with pytest.raises(TokenCheckError) as info:
        check_token_files(prep, meta, tok, report_dir)
    assert str(info.value).splitlines() == [
        "token checks FAILED:",
        " - train: ids below vocab size: 1 ids ≥ 320 (largest 999)",
        " - train: no empty documents: 1 empty documents (EOS right after EOS)",
        " - train: shards end at document ends: 2 shard(s); 1 end inside a document",
        " - val: ends with EOS: the last document has no EOS: the file is truncated",
        " - train/val: no shared documents: 1 documents are in both splits"]
    report = json.loads((report_dir / "token_report.json").read_text())
    assert report["success"] is False and report["checks"][-1]["examples"] == ["Document 1"]
    assert report["splits"]["train"]["documents"] == 5 and report["splits"]["train"]["max_id"] == 999
    assert "Token checks FAILED" in (report_dir / "token_report.html").read_text()


def test_token_files_in_shards_read_as_one_split(tmp_path, tokenizer_dir):
    """A small prepare.shard_tokens gives several files per split, each starting at a document; read through
    load_split they are the one-file split id for id (slices across files included), so the loader's batches and
    its resumable order do not change."""
    from ultrathink.train.loader import TokenWindows

    corpus = write_jsonl(tmp_path / "c.jsonl", DOCS * 4)
    one = prepare_splits(corpus, tokenizer_dir, PrepareConfig(val_fraction=0.2, batch_size=7, workers=1),
                         tmp_path / "one", report_dir=tmp_path / "r1")
    many = prepare_splits(corpus, tokenizer_dir, PrepareConfig(val_fraction=0.2, batch_size=7, workers=1,
                                                               shard_tokens=100), tmp_path / "many",
                          report_dir=tmp_path / "r2")
    assert len(one["train"]["shards"]) == 1 and len(many["train"]["shards"]) > 5
    assert {k: v for k, v in many["train"].items() if k != "shards"} == {
        k: v for k, v in one["train"].items() if k != "shards"}
    eos = one["eos_id"]
    for split in ("train", "val"):
        whole, sharded = load_split(tmp_path / "one", split), load_split(tmp_path / "many", split)
        assert len(sharded) == len(whole) and np.array_equal(np.asarray(sharded), np.asarray(whole))
        assert all(int(sharded[int(end) - 1]) == eos for end in sharded.ends)  # each file ends a document
        assert all(shard["tokens"] >= 100 for shard in many[split]["shards"][:-1])  # rolled over at the bound
        for cut in sharded.ends[:3]:  # slices that cross a file boundary, an id at each side of it, negative ids
            assert np.array_equal(sharded[cut - 5 : cut + 5], whole[cut - 5 : cut + 5])
            assert sharded[int(cut)] == whole[int(cut)] and sharded[-1] == whole[-1] == eos
    a, b = (TokenWindows(load_split(tmp_path / d, "train"), 16, 4, seed=3) for d in ("one", "many"))
    for _ in range(30):
        (xa, ya), (xb, yb) = next(a), next(b)
        assert torch_equal(xa, xb) and torch_equal(ya, yb)
    checks = json.loads((tmp_path / "r2" / "token_report.json").read_text())["checks"]
    assert {c["name"]: c["success"] for c in checks}["train: shards end at document ends"]
    (tmp_path / "many" / many["train"]["shards"][2]["file"]).write_bytes(b"\0\0")  # a shard cut short
    with pytest.raises(ValueError, match="train-00002.bin holds 1 tokens, meta.json says"):
        load_split(tmp_path / "many", "train")


def torch_equal(a, b) -> bool:
    return bool((a == b).all())
