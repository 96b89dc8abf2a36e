"""More sources: csv, globs, save_to_disk datasets, hf: names (a local dataset folder; the offline error), streaming,
weighted mixtures; each bad input names what is wrong."""

import json

import datasets
import pandas as pd
import pytest

from ultrathink.config import DataConfig, MixtureSource
from ultrathink.data.sources import CorpusError, load_corpus


def write_jsonl(path, texts, key="text"):
    path.write_text("".join(json.dumps({key: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def texts(cfg, root):
    return load_corpus(cfg, root=root)["text"].tolist()


def test_csv_with_text_column_keeps_nulls_and_newlines(tmp_path):
    (tmp_path / "c.csv").write_text('id,body\n1,hello\n2,\n3,"multi\nline"\n')
    assert texts(DataConfig(source="c.csv", text_column="body"), tmp_path) == ["hello", None, "multi\nline"]


def test_glob_reads_matching_files_in_sorted_order(tmp_path):
    (tmp_path / "raw").mkdir()
    write_jsonl(tmp_path / "raw" / "b.jsonl", ["b1", "b2"])
    write_jsonl(tmp_path / "raw" / "a.jsonl", ["a1"])
    (tmp_path / "raw" / "x.txt").write_text("p1\n\np2\n")
    assert texts(DataConfig(source="raw/*.jsonl"), tmp_path) == ["a1", "b1", "b2"]
    assert texts(DataConfig(source="raw/*.jsonl", max_samples=2), tmp_path) == ["a1", "b1"]
    assert texts(DataConfig(source="raw/*.txt"), tmp_path) == ["p1", "p2"]
    with pytest.raises(CorpusError, match=r"no corpus files match .*raw/\*\.parquet"):
        load_corpus(DataConfig(source="raw/*.parquet"), root=tmp_path)
    with pytest.raises(CorpusError, match=r"several formats \(\.jsonl, \.txt\)"):
        load_corpus(DataConfig(source="raw/*"), root=tmp_path)


def test_save_to_disk_dataset_and_dataset_dict(tmp_path):
    datasets.Dataset.from_dict({"content": ["x", "y", None]}).save_to_disk(tmp_path / "one")
    assert texts(DataConfig(source="one", text_column="content"), tmp_path) == ["x", "y", None]
    assert texts(DataConfig(source="one", text_column="content", streaming=True, max_samples=2), tmp_path) == ["x", "y"]
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["t"]}),
                          "test": datasets.Dataset.from_dict({"text": ["u", "v"]})}).save_to_disk(tmp_path / "dd")
    assert texts(DataConfig(source="dd", split="test"), tmp_path) == ["u", "v"]
    with pytest.raises(CorpusError, match=r"dd: no split 'valid' \(data.split\); splits: train, test"):
        load_corpus(DataConfig(source="dd", split="valid"), root=tmp_path)
    with pytest.raises(CorpusError, match=r"one: no column 'text' \(data.text_column\); columns: content"):
        load_corpus(DataConfig(source="one"), root=tmp_path)


def test_plain_directory_is_not_a_dataset(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(CorpusError, match=r"not a dataset saved with save_to_disk.*use a glob such as .*d/\*\.jsonl"):
        load_corpus(DataConfig(source="d"), root=tmp_path)


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet", ".csv"])
def test_streaming_reads_the_same_texts(tmp_path, suffix):
    docs = [f"document {i} é" for i in range(25)]
    path = tmp_path / f"c{suffix}"
    if suffix == ".jsonl":
        write_jsonl(path, docs)
    elif suffix == ".parquet":
        pd.DataFrame({"text": docs}).to_parquet(path)
    else:
        pd.DataFrame({"text": docs}).to_csv(path, index=False)
    for limit in (None, 7):
        eager = texts(DataConfig(source=path.name, max_samples=limit), tmp_path)
        assert texts(DataConfig(source=path.name, max_samples=limit, streaming=True), tmp_path) == eager
        assert eager == docs[:limit]


def test_hf_name_loads_through_load_dataset_streaming_or_not(tmp_path):
    # A dataset repository laid out on disk: load_dataset(NAME) takes a local folder the same way as a hub name.
    (tmp_path / "repo" / "data").mkdir(parents=True)
    write_jsonl(tmp_path / "repo" / "data" / "train.jsonl", ["r1", "r2", "r3"], key="content")
    name = f"hf:{tmp_path / 'repo'}"
    for streaming in (False, True):
        cfg = DataConfig(source=name, text_column="content", streaming=streaming, max_samples=2)
        assert texts(cfg, tmp_path) == ["r1", "r2"]
    with pytest.raises(CorpusError, match=r"cannot be loaded \(config None, split 'test'\)"):
        load_corpus(DataConfig(source=name, split="test", text_column="content"), root=tmp_path)


def test_unreachable_hub_dataset_says_offline_and_how_to_fix(tmp_path):
    with pytest.raises(CorpusError) as info:
        load_corpus(DataConfig(source="hf:nobody/no-such-dataset"), root=tmp_path)
    message = str(info.value)
    assert message.startswith("hf:nobody/no-such-dataset: cannot be reached: this machine is offline")
    assert "save_to_disk" in message and "data/raw/" in message


def test_unknown_column_of_a_streamed_file_lists_columns(tmp_path):
    write_jsonl(tmp_path / "c.jsonl", ["a"], key="body")
    with pytest.raises(CorpusError, match=r"c\.jsonl: no column 'text' \(data.text_column\); columns: body, id"):
        load_corpus(DataConfig(source="c.jsonl", streaming=True), root=tmp_path)


def mixture_files(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [f"a{i}" for i in range(30)])
    write_jsonl(tmp_path / "b.jsonl", [f"b{i}" for i in range(20)], key="body")
    return [MixtureSource(source="a.jsonl", weight=3), MixtureSource(source="b.jsonl", weight=1, text_column="body")]


def test_mixture_takes_weighted_shares_in_a_seeded_order(tmp_path):
    mixture = mixture_files(tmp_path)
    df = load_corpus(DataConfig(mixture=mixture, max_samples=20, seed=1), root=tmp_path)
    assert df["source"].value_counts().to_dict() == {"a.jsonl": 15, "b.jsonl": 5}
    got = df["text"].tolist()
    assert [t for t in got if t[0] == "a"] == [f"a{i}" for i in range(15)]  # each source's own order is kept
    assert [t for t in got if t[0] == "b"] == [f"b{i}" for i in range(5)]
    assert texts(DataConfig(mixture=mixture, max_samples=20, seed=1), tmp_path) == got  # deterministic
    assert texts(DataConfig(mixture=mixture, max_samples=20, seed=2), tmp_path) != got
    # Without max_samples: as many as the scarcest source allows at its weight (a: 30/0.75 = 40 < b: 20/0.25 = 80).
    full = load_corpus(DataConfig(mixture=mixture), root=tmp_path)
    assert full["source"].value_counts().to_dict() == {"a.jsonl": 30, "b.jsonl": 10}


def test_mixture_component_too_small_for_its_weight(tmp_path):
    mixture = mixture_files(tmp_path)
    with pytest.raises(CorpusError, match=r"source 'a.jsonl' has 30 documents; its weight asks for 75 of "
                                          r"data.max_samples=100"):
        load_corpus(DataConfig(mixture=mixture, max_samples=100), root=tmp_path)


def test_a_mixture_in_batches_is_the_mixture_drawn_whole(tmp_path):
    from ultrathink.data.sources import corpus_batches

    mixture = mixture_files(tmp_path)
    for cfg in (DataConfig(mixture=mixture, seed=4), DataConfig(mixture=mixture, max_samples=20, seed=1)):
        whole = load_corpus(cfg, root=tmp_path)
        batches = list(corpus_batches(cfg, tmp_path, rows=3))
        assert max(len(b) for b in batches) == 3
        joined = pd.concat(batches, ignore_index=True)
        assert joined["text"].tolist() == whole["text"].tolist()
        assert joined["source"].tolist() == whole["source"].tolist()
