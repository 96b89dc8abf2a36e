"""The validate stage in bounded memory: the gates summed over batches report what one pass over the whole corpus
reports (same failures, same counts, same examples), duplicates are found across batches by hash, and the corpus is
written as Parquet shards with an index that prepare reads back in order."""

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from ultrathink.config import Params, ValidateConfig
from ultrathink.data.cleaning import SeenHashes
from ultrathink.data.shards import ShardWriter, read_index, read_shards
from ultrathink.data.validation import CorpusValidationError, SourceGate, validate_corpus

CFG = ValidateConfig(min_rows=50, max_length=200, length_mostly=0.9, max_duplicate_fraction=0.1,
                     min_printable_ratio=0.9)


def distinct(n: int, start: int = 0) -> list[str]:
    return [f"document number {i} talks about topic {i * 7 % 13}" for i in range(start, start + n)]


BAD_CORPORA = {
    "nulls": distinct(60) + [None] * 5,
    "too long": distinct(60) + ["x" * 500] * 8 + distinct(3, 100),
    "duplicates across batches": distinct(40) + distinct(20),  # the repeats come long after their originals
    "unprintable": distinct(55) + ["\x00\x01\x02 binary"] * 2 + distinct(2, 300),
    "too few rows": distinct(30),
}


def in_batches(texts: list, rows: int):
    for start in range(0, len(texts), rows):
        yield pd.DataFrame({"text": pd.Series(texts[start : start + rows], dtype=object)})


@pytest.mark.parametrize("case", sorted(BAD_CORPORA))
def test_the_streamed_gate_reports_what_the_whole_corpus_gate_reports(case):
    texts = BAD_CORPORA[case]
    whole = validate_corpus(pd.DataFrame({"text": pd.Series(texts, dtype=object)}), CFG)
    gate = SourceGate(CFG)
    for batch in in_batches(texts, rows=7):
        gate.add(batch)
    streamed = gate.report()
    assert not whole.success and streamed.success == whole.success and streamed.n_rows == len(texts)
    for a, b in zip(whole.results, streamed.results):
        assert (a["name"], a["success"], a["unexpected_count"], a["checked_rows"], a["message"], a["examples"]) == (
            b["name"], b["success"], b["unexpected_count"], b["checked_rows"], b["message"], b["examples"]), case
        assert a["observed"] == pytest.approx(b["observed"])
    assert streamed.summary() == whole.summary()


def test_a_bound_of_all_rows_passes_however_many_fail():
    texts = distinct(10) * 8  # 87.5% repeats
    gate = SourceGate(CFG.model_copy(update={"max_duplicate_fraction": 1.0}))
    for batch in in_batches(texts, rows=7):
        gate.add(batch)
    duplicates = {r["name"]: r for r in gate.report().results}["duplicates"]
    assert duplicates["success"] and duplicates["unexpected_count"] == 70
    strict = SourceGate(CFG)
    strict.add(pd.DataFrame({"text": pd.Series(texts, dtype=object)}))
    assert not {r["name"]: r for r in strict.report().results}["duplicates"]["success"]


def test_seen_hashes_finds_every_repeat_in_order_across_batches():
    rng = np.random.default_rng(0)
    values = [f"text {v}" for v in rng.integers(0, 500, size=3000)]
    seen, flags = SeenHashes(), []
    for start in range(0, len(values), 97):
        flags += seen.add(values[start : start + 97]).tolist()
    expected, earlier = [], set()
    for v in values:
        expected.append(v in earlier)
        earlier.add(v)
    assert flags == expected and len(seen) == len(earlier)
    assert len(seen.runs) <= 12  # merged runs: lookups stay a few binary searches


def test_shards_roll_over_and_read_back_in_order(tmp_path):
    texts = [f"line {i} " + "é" * (i % 5) for i in range(1000)]
    writer = ShardWriter(tmp_path, shard_bytes=3000)
    for start in range(0, len(texts), 100):
        writer.write(texts[start : start + 100])
    index = writer.close()
    assert len(index["shards"]) > 2 and index["documents"] == 1000
    assert index["bytes"] == sum(len(t.encode()) for t in texts)
    assert list(read_shards(tmp_path)) == texts and read_index(tmp_path) == index


def run_validate(root: Path, monkeypatch, texts: list, **validate) -> dict:
    from ultrathink.stages.validate import run

    monkeypatch.chdir(root)
    Path("raw.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    run(Params.model_validate({"data": {"source": "raw.jsonl"}, "constitution": {"path": None},
                               "validate": {"min_rows": 10, "max_duplicate_fraction": 0.5, **validate}}))
    return json.loads(Path("reports/validate.json").read_text())


def test_the_stage_writes_the_same_corpus_and_report_in_small_batches(tmp_path, monkeypatch):
    texts = distinct(300) + distinct(50, 10) + ["  padded  "] * 3
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    whole = run_validate(tmp_path / "a", monkeypatch, texts, batch_rows=100_000)
    small = run_validate(tmp_path / "b", monkeypatch, texts, batch_rows=16, shard_mb=0.002)
    corpus_a = list(read_shards(tmp_path / "a/data/validated/corpus"))
    corpus_b = list(read_shards(tmp_path / "b/data/validated/corpus"))
    assert corpus_a == corpus_b and len(corpus_a) == 301  # 50 repeats and 2 of the padded copies removed
    assert whole["cleaning"] == small["cleaning"] and whole["cleaning"]["duplicates_removed"] == 52
    assert [r["unexpected_count"] for r in whole["results"]] == [r["unexpected_count"] for r in small["results"]]
    assert whole["shards"] == 1 and small["shards"] > 3


def test_a_failing_corpus_leaves_no_new_shards(tmp_path, monkeypatch):
    run_validate(tmp_path, monkeypatch, distinct(40))
    good = list(read_shards(tmp_path / "data/validated/corpus"))
    with pytest.raises(CorpusValidationError, match="text not null: 5 of 45 rows are null"):
        run_validate(tmp_path, monkeypatch, distinct(40, 1000) + [None] * 5, batch_rows=8)
    assert list(read_shards(tmp_path / "data/validated/corpus")) == good
    assert not [p for p in (tmp_path / "data/validated").iterdir() if p.name.startswith(".")]  # no temp left
