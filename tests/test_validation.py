"""validate_corpus: a real Great Expectations suite, with the failures named, counted and illustrated."""

import json

import pandas as pd
import pytest

from ultrathink.config import ValidateConfig
from ultrathink.data.validation import CorpusValidationError, printable_ratio, validate_corpus

CFG = ValidateConfig(min_rows=10, min_length=1, max_length=500, length_mostly=0.99, max_duplicate_fraction=0.05,
                     min_printable_ratio=0.95)


def corpus(texts) -> pd.DataFrame:
    return pd.DataFrame({"text": pd.Series(texts, dtype=object)})


def distinct(n: int) -> list[str]:
    return [f"Document number {i}:\n\tsome ordinary text." for i in range(n)]


def by_name(report) -> dict:
    return {r["name"]: r for r in report.results}


def test_good_corpus_passes():
    report = validate_corpus(corpus(distinct(40)), CFG)
    assert report.success and report.n_rows == 40
    assert [r["name"] for r in report.results] == [
        "text not null", "text length", "duplicates", "printable characters", "row count"]
    assert all(r["success"] for r in report.results)
    assert by_name(report)["row count"]["observed"] == 40
    assert report.summary() == "Corpus validation passed (5 expectations, 40 rows)"


def test_all_null_corpus_fails_not_null_with_count():
    report = validate_corpus(corpus([None] * 40), CFG)
    assert not report.success
    result = by_name(report)["text not null"]
    assert not result["success"] and result["unexpected_count"] == 40
    assert result["examples"] == [{"row": 0, "text": None}, {"row": 1, "text": None}, {"row": 2, "text": None}]
    # Nulls are only the not-null check's business: the per-document checks have nothing left to judge.
    assert [r["name"] for r in report.results if not r["success"]] == ["text not null"]
    assert "Corpus validation FAILED (1 of 5 expectations, 40 rows)" in report.summary()
    assert " - text not null: 40 of 40 rows are null" in report.summary()


def test_pandas_string_dtype_nan_counts_as_null():
    df = pd.DataFrame({"text": distinct(20) + [None, None]})  # pandas' str dtype stores the nulls as NaN
    result = by_name(validate_corpus(df, CFG))["text not null"]
    assert result["unexpected_count"] == 2
    assert [e["row"] for e in result["examples"]] == [20, 21]


@pytest.mark.parametrize("df", [corpus([]), pd.DataFrame()], ids=["empty text column", "no columns"])
def test_empty_corpus_fails_readably(df):
    report = validate_corpus(df, CFG)
    assert not report.success and report.n_rows == 0
    assert report.summary() == (
        "Corpus validation FAILED (1 of 5 expectations, 0 rows):\n - row count: 0 rows; at least 10 are needed")


def test_half_duplicates_fail_one_percent_passes():
    half = validate_corpus(corpus(distinct(100) * 2), CFG)
    dup = by_name(half)["duplicates"]
    assert not half.success and not dup["success"]
    assert dup["unexpected_count"] == 100 and dup["observed"] == 50.0
    assert dup["examples"][0]["row"] == 100  # the first repeat, not the original it repeats
    assert "duplicates: 100 of 200 documents (50.0%) repeat an earlier document; at most 5.0% may" in half.summary()

    one_percent = validate_corpus(corpus(distinct(198) + distinct(2)), CFG)
    assert by_name(one_percent)["duplicates"]["unexpected_count"] == 2
    assert one_percent.success


def test_duplicate_fraction_at_the_limit_passes():
    texts = distinct(95) + distinct(5)  # exactly 5% of rows repeat an earlier row
    assert validate_corpus(corpus(texts), CFG).success
    assert not validate_corpus(corpus(distinct(94) + distinct(6)), CFG).success


def test_non_printable_document_fails_printable_check():
    texts = distinct(30)
    texts[7] = "ok" + "\x00\x01\x02\x1b" * 30
    report = validate_corpus(corpus(texts), CFG)
    result = by_name(report)["printable characters"]
    assert not result["success"] and result["unexpected_count"] == 1
    assert result["examples"] == [{"row": 7, "text": texts[7][:79] + "…"}]
    assert "printable characters: 1 of 30 documents have less than 95% printable characters" in report.summary()


def test_printable_ratio_counts_layout_whitespace_as_printable():
    assert printable_ratio("ab\x00\x01") == 0.5
    assert printable_ratio("a\nb\tc\r\n") == 1.0
    assert printable_ratio("") == 1.0
    assert printable_ratio("é🤗中") == 1.0


def test_length_failures_show_truncated_examples():
    texts = distinct(20) + ["x" * 1000, "y" * 600, ""]
    report = validate_corpus(corpus(texts), CFG)
    result = by_name(report)["text length"]
    assert not result["success"] and result["unexpected_count"] == 3
    assert result["examples"] == [
        {"row": 20, "text": "x" * 79 + "…"}, {"row": 21, "text": "y" * 79 + "…"}, {"row": 22, "text": ""}]
    assert "text length: 3 of 23 documents (13.0%) are not 1 to 500 characters long; at most 1.0% may be" in (
        report.summary())
    assert max(len(line) for line in report.summary().splitlines()) < 400


def test_report_is_json_serialisable_and_error_carries_it():
    report = validate_corpus(corpus([None, "a", "a"]), CFG)
    data = json.loads(json.dumps(report.to_dict()))
    assert data["success"] is False and data["n_rows"] == 3
    assert {r["name"]: r["success"] for r in data["results"]} == {
        "text not null": False, "text length": True, "duplicates": False, "printable characters": True,
        "row count": False}
    error = CorpusValidationError(report)
    assert error.report is report and str(error) == report.summary()


def test_missing_text_column_is_a_clear_error():
    with pytest.raises(ValueError, match="corpus has no 'text' column; columns: body"):
        validate_corpus(pd.DataFrame({"body": ["a"]}), CFG)


def test_non_string_value_names_the_row():
    with pytest.raises(ValueError, match="column 'text' row 1: expected str or null, got int"):
        validate_corpus(corpus(["a", 5]), CFG)
