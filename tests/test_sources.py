"""load_corpus: every source gives one object "text" column with the exact texts, nulls kept, clear errors."""

import json
import sys
import types

import pandas as pd
import pytest

from ultrathink.config import DataConfig
from ultrathink.data.reference import reference_topics
from ultrathink.data.sources import CorpusError, load_corpus, split_paragraphs
from ultrathink.finetune.pairs import embedded_pairs


def test_embedded_corpus_is_the_python_reference_in_paragraphs():
    df = load_corpus(DataConfig(source="embedded"))
    assert list(df.columns) == ["text"]
    assert df["text"].dtype == object
    assert len(df) > 1000
    texts = df["text"].tolist()
    assert all(isinstance(t, str) and t and t == t.strip() for t in texts)
    assert any("assignment" in t for t in texts)
    assert load_corpus(DataConfig(source="embedded"))["text"].tolist() == texts  # deterministic order


def test_the_embedded_texts_are_the_snapshot_whatever_the_interpreter_ships(monkeypatch):
    """The embedded corpus and fine-tuning pairs come from the snapshot shipped with the code, not from the running
    CPython's pydoc_data, whose pages change between patch releases (17 of 79 differ from 3.11.2 to 3.11.7): an
    interpreter with other pages gives the same texts."""
    texts, pairs = load_corpus(DataConfig(source="embedded"))["text"].tolist(), embedded_pairs()
    other_release = types.ModuleType("pydoc_data.topics")
    other_release.topics = {"assert": 'The "assert" statement\n**********************\n\nWords of another release.'}
    monkeypatch.setitem(sys.modules, "pydoc_data.topics", other_release)
    assert load_corpus(DataConfig(source="embedded"))["text"].tolist() == texts
    assert embedded_pairs() == pairs
    assert texts[:2] == ['The "assert" statement\n**********************',
                         "Assert statements are a convenient way to insert debugging assertions\ninto a program:"]
    with pytest.raises(TypeError):  # one copy per process, shared by its callers: read-only
        reference_topics()["assert"] = "edited"


def test_max_samples_keeps_the_first_documents():
    full = load_corpus(DataConfig())["text"].tolist()
    assert load_corpus(DataConfig(max_samples=7))["text"].tolist() == full[:7]


def test_split_paragraphs_on_blank_lines():
    text = "first line\nsecond line\n\n\n   second para  \n \t\nthird\n\n"
    assert split_paragraphs(text) == ["first line\nsecond line", "second para", "third"]


def test_txt_file_relative_to_root(tmp_path):
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "c.txt").write_text("héllo wörld\n\nsecond 🤗 para\n", encoding="utf-8")
    df = load_corpus(DataConfig(source="raw/c.txt"), root=tmp_path)
    assert df["text"].tolist() == ["héllo wörld", "second 🤗 para"]


def test_jsonl_keeps_nulls_and_exact_texts(tmp_path):
    rows = [{"body": "  spaced  ", "n": 1}, {"body": None, "n": 2}, {"n": 3}, {"body": "line\nbreak ✓", "n": 4}]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    df = load_corpus(DataConfig(source="c.jsonl", text_column="body"), root=tmp_path)
    assert list(df.columns) == ["text"]
    assert df["text"].dtype == object
    assert df["text"].tolist() == ["  spaced  ", None, None, "line\nbreak ✓"]


def test_json_array_file(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps([{"text": "a"}, {"text": "b"}, {"text": "c"}]))
    df = load_corpus(DataConfig(source="c.json", max_samples=2), root=tmp_path)
    assert df["text"].tolist() == ["a", "b"]


def test_parquet_file(tmp_path):
    pd.DataFrame({"text": ["x", None, "zé"], "id": [1, 2, 3]}).to_parquet(tmp_path / "c.parquet")
    df = load_corpus(DataConfig(source="c.parquet"), root=tmp_path)
    assert df["text"].tolist() == ["x", None, "zé"]


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(CorpusError, match=r"corpus file not found: .*nope\.jsonl"):
        load_corpus(DataConfig(source="nope.jsonl"), root=tmp_path)


def test_unsupported_extension_lists_supported(tmp_path):
    (tmp_path / "c.xml").write_text("<text>a</text>\n")
    with pytest.raises(CorpusError, match=r"c\.xml: unsupported corpus format '\.xml'; "
                       r"supported: \.txt, \.json, \.jsonl, \.parquet, \.csv"):
        load_corpus(DataConfig(source="c.xml"), root=tmp_path)


def test_unknown_text_column_lists_existing_columns(tmp_path):
    (tmp_path / "c.jsonl").write_text('{"content": "a", "id": 1}\n')
    with pytest.raises(CorpusError) as info:
        load_corpus(DataConfig(source="c.jsonl", text_column="body"), root=tmp_path)
    message = str(info.value)
    assert "c.jsonl" in message and "no column 'body'" in message and "columns: content, id" in message


def test_non_string_text_column_is_rejected(tmp_path):
    (tmp_path / "c.jsonl").write_text('{"text": 1}\n{"text": 2}\n')
    with pytest.raises(CorpusError, match="column 'text' holds .*int64.*expected strings"):
        load_corpus(DataConfig(source="c.jsonl"), root=tmp_path)


def test_invalid_utf8_txt_names_the_file(tmp_path):
    (tmp_path / "c.txt").write_bytes(b"ok\n\nbad \xff byte")
    with pytest.raises(CorpusError, match=r"c\.txt: not valid UTF-8 at byte 8"):
        load_corpus(DataConfig(source="c.txt"), root=tmp_path)


@pytest.mark.parametrize("unit", ["paragraph", "line"])
def test_txt_read_a_line_at_a_time_equals_splitting_the_whole_text(tmp_path, unit):
    import random

    from ultrathink.data.sources import split_documents

    pieces = ["word", "two words", " ", "\t", "\n", "\n", "\r\n", "\r", "\x0c", "\u2028", "é", "  \n  "]
    rng = random.Random(0)
    for case in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))
        path = tmp_path / f"c{case}.txt"
        path.write_bytes(text.encode("utf-8"))
        whole = split_documents(path.read_text(encoding="utf-8"), unit)  # universal newlines, as before
        assert load_corpus(DataConfig(source=path.name, txt_unit=unit), root=tmp_path)["text"].tolist() == whole, text
