"""Cleaning steps and the constitution on hand-made corpora with known answers; the cleaned-corpus gate."""

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from ultrathink.config import DataConfig, Params
from ultrathink.data.cleaning import (clean_corpus, drop_by_length, drop_exact_duplicates, drop_unprintable,
                                      normalize_unicode)
from ultrathink.data.constitution import ConstitutionError, apply_constitution, load_constitution, luhn_valid
from ultrathink.data.shards import read_shards
from ultrathink.data.validation import CorpusValidationError, validate_cleaned

ROOT = Path(__file__).resolve().parents[1]
VALID_CARD = "4111 1111 1111 1111"  # passes the Luhn check
INVALID_CARD = "4111 1111 1111 1112"  # the same digits with a wrong check digit


def frame(texts):
    return pd.DataFrame({"text": pd.Series(texts, dtype=object)})


@pytest.fixture(scope="module")
def principles():
    return load_constitution(ROOT / "constitution.yaml")


def test_normalization_forms():
    df = frame(["cafe\u0301", "ﬁne", "plain"])
    nfc, changed = normalize_unicode(df, "NFC")
    assert nfc["text"].tolist() == ["café", "ﬁne", "plain"] and changed == 1
    nfkc, changed = normalize_unicode(df, "NFKC")
    assert nfkc["text"].tolist() == ["café", "fine", "plain"] and changed == 2
    assert normalize_unicode(df, "none") == (df, 0)


def test_printable_length_and_duplicate_filters():
    kept, removed = drop_unprintable(frame(["ok text", "\x00\x01\x02ab", "tab\tand\nnewline"]), 0.9)
    assert kept["text"].tolist() == ["ok text", "tab\tand\nnewline"] and removed == 1
    kept, short, long = drop_by_length(frame(["", "abc", "abcdef", "abcdefghij"]), 1, 6)
    assert kept["text"].tolist() == ["abc", "abcdef"] and (short, long) == (1, 1)
    kept, removed = drop_exact_duplicates(frame(["b", "a", "b", "c", "a"]).assign(n=range(5)))
    assert kept["text"].tolist() == ["b", "a", "c"] and kept["n"].tolist() == [0, 1, 3] and removed == 2


def test_luhn():
    assert luhn_valid("4111111111111111") and luhn_valid("79927398713")
    assert not luhn_valid("4111111111111112") and not luhn_valid("79927398710") and not luhn_valid("12a4")


def test_three_emails_and_one_valid_card_are_redacted_invalid_card_is_left(principles):
    docs = [
        "Write to alice@example.com or bob.smith+tag@mail.example.org today.",
        f"Card {VALID_CARD} was charged; card {INVALID_CARD} was declined.",
        "Ping carol_99@uni.ac.uk about the order.",
        "Nothing personal here.",
    ]
    cleaned, counts = apply_constitution(frame(docs), principles)
    assert cleaned["text"].tolist() == [
        "Write to <|email|> or <|email|> today.",
        f"Card <|credit_card|> was charged; card {INVALID_CARD} was declined.",
        "Ping <|email|> about the order.",
        "Nothing personal here.",
    ]
    assert counts["email"] == {"action": "redact", "documents": 2, "matches": 3, "redactions": 3}
    assert counts["credit_card"] == {"action": "redact", "documents": 1, "matches": 1, "redactions": 1}
    assert all(counts[p]["matches"] == 0 for p in ("phone", "ipv4", "secret", "spam"))


def test_phone_ip_and_secret_detectors(principles):
    docs = ["Call +1 555 123 4567 or (555) 123-4567, version 3.11.4 is not a phone.",
            "Server at 192.168.0.1. Not an address: 999.1.1.1 or 1.2.3",
            "export API_KEY=abcdef0123456789abcdef and key AKIAABCDEFGHIJKLMNOP"]
    cleaned, counts = apply_constitution(frame(docs), principles)
    assert cleaned["text"].tolist() == [
        "Call <|phone|> or <|phone|>, version 3.11.4 is not a phone.",
        "Server at <|ipv4|>. Not an address: 999.1.1.1 or 1.2.3",
        "export <|secret|> and key <|secret|>"]
    assert (counts["phone"]["redactions"], counts["ipv4"]["redactions"], counts["secret"]["redactions"]) == (2, 1, 2)


def test_drop_and_flag_actions_and_the_cleaned_gate(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("""
principles:
  - name: spam
    action: drop
    detectors: [{words: [casino bonus]}]
  - name: rude
    action: flag
    max_rate: 0.25
    detectors: [{words: [darn]}]
""")
    principles = load_constitution(path)
    docs = ["Get a CASINO BONUS now", "darn it", "a casinos bonus is fine", "Darn, darn!", "clean", "fine"]
    cleaned, counts = apply_constitution(frame(docs), principles)
    assert cleaned["text"].tolist() == docs[1:]
    assert counts == {"spam": {"action": "drop", "documents": 1, "matches": 1, "documents_dropped": 1},
                      "rude": {"action": "flag", "documents": 2, "matches": 3, "documents_flagged": 2}}
    report = validate_cleaned(cleaned, principles, min_rows=3)
    assert not report.success  # 2 of 5 flagged documents (40%) > 25%
    assert report.summary().splitlines()[:2] == [
        "Cleaned corpus validation FAILED (1 of 3 expectations, 5 rows):",
        " - constitution: rude: 2 of 5 cleaned documents (40.0%) still match principle 'rude' (action flag); "
        "at most 25.0% may"]
    assert validate_cleaned(cleaned[1:], principles, min_rows=3).success  # 1 of 4 = 25%


def test_constitution_file_errors_name_file_and_principle(tmp_path):
    with pytest.raises(ConstitutionError, match=r"constitution file not found: .*absent\.yaml"):
        load_constitution(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("principles:\n  - {name: x, action: redact, detectors: [{regex: '(unclosed'}]}\n")
    with pytest.raises(ConstitutionError, match=r"bad\.yaml: principle 'x': invalid regex '\(unclosed'"):
        load_constitution(bad)
    bad.write_text("principles:\n  - {name: x, action: erase, detectors: [{words: [a]}]}\n"
                   "  - {name: x, action: drop, detectors: [{words: [a], regex: b}]}\n")
    with pytest.raises(ConstitutionError) as info:
        load_constitution(bad)
    assert "principles.0.action: Input should be 'redact', 'drop' or 'flag'" in str(info.value)
    assert "exactly one of 'regex' or 'words'" in str(info.value)


def test_clean_corpus_counts_every_step(principles):
    docs = ["cafe\u0301 mail me at x@y.io", "café mail me at z@w.io", "\x00\x01\x02\x03", "hi",
            "Buy VIAGRA here", "a normal document", "a normal document"]
    cfg = DataConfig(normalize="NFC", min_chars=3, max_chars=100, min_printable_ratio=0.9)
    cleaned, report = clean_corpus(frame(docs), cfg, principles)
    assert cleaned["text"].tolist() == ["café mail me at <|email|>", "a normal document"]
    assert {k: v for k, v in report.items() if k != "constitution"} == {
        "documents_in": 7, "normalized_documents": 1, "unprintable_removed": 1, "too_short_removed": 1,
        "too_long_removed": 0, "duplicates_removed": 2, "documents_kept": 2}
    assert report["constitution"]["email"]["redactions"] == 2
    assert report["constitution"]["spam"]["documents_dropped"] == 1


def test_validate_stage_writes_cleaning_report_and_fails_on_flagged_pii(tmp_path, monkeypatch):
    shutil.copy(ROOT / "constitution.yaml", tmp_path)
    monkeypatch.chdir(tmp_path)
    from ultrathink.stages.validate import run

    docs = [f"document {i} is about topic {i * 7}" for i in range(30)] + ["mail a@b.org", "mail a@b.org"]
    Path("raw.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    params = Params.model_validate({"data": {"source": "raw.jsonl"}, "validate": {"min_rows": 10}})
    run(params)
    report = json.loads(Path("reports/validate.json").read_text())
    assert report["cleaning"]["constitution"]["email"]["redactions"] == 2
    assert (report["cleaning"]["duplicates_removed"], report["cleaning"]["documents_kept"]) == (1, 31)
    assert report["cleaned"]["success"]
    written = list(read_shards(Path("data/validated/corpus")))
    assert len(written) == 31 and "mail <|email|>" in written

    Path("constitution.yaml").write_text(
        Path("constitution.yaml").read_text().replace("name: email\n    description: e-mail addresses\n    action: redact",
                                                      "name: email\n    description: e-mail addresses\n    action: flag"))
    with pytest.raises(CorpusValidationError, match=r"constitution: email: 1 of 31 cleaned documents \(3\.2%\) "
                                                    r"still match principle 'email' \(action flag\)"):
        run(params)
    assert json.loads(Path("reports/validate.json").read_text())["cleaned"]["success"] is False
    assert list(read_shards(Path("data/validated/corpus"))) == written  # the failed run left the last good corpus


# The shipped patterns before they were rewritten for speed (lookbehind first): the rewrite must match the same spans.
_LOOKBEHIND_FIRST = {
    "credit_card": [r"(?<![\d-])\d(?:[ -]?\d){12,18}(?![\d-])"],
    "phone": [r"(?<![\w+])\+\d{1,3}(?:[ .-]\d{1,4}){2,4}(?![\w-])",
              r"(?<![\w+(])(?:\(\d{3}\) ?|\d{3}[.-])\d{3}[.-]\d{4}(?![\w-])"],
    "ipv4": [r"(?<![\w.])(?:(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)(?!\.?\d)"],
    "secret": [r"\b(?:sk-[A-Za-z0-9_-]{20,}|AKIA[0-9A-Z]{16}|gh[pousr]_[A-Za-z0-9]{36,}|xox[abprs]-[A-Za-z0-9-]{10,}"
               r"|AIza[0-9A-Za-z_-]{35})\b",
               r"(?i)\b(?:api[_-]?key|secret[_-]?key|access[_-]?token|auth[_-]?token|password)\s*[:=]\s*['\"]?"
               r"[A-Za-z0-9/+_.-]{16,}['\"]?"],
    "spam": [r"(?i)(?<!\w)(?:work\ from\ home\ and\ earn|claim\ your\ prize|buy\ followers|casino\ bonus|cialis|"
             r"viagra)(?!\w)"],
}
_TRICKY = [f"{before}{body}{after}" for body in (VALID_CARD, "4111-1111-1111-1111", "+1 555 123 4567",
                                                  "+44 20 7946 0958", "(555) 123-4567", "(555)123-4567",
                                                  "555-123-4567", "555.123.4567",
                                                  "192.168.0.1", "10.0.0.255", "256.1.1.1", "1.2.3.4.5",
                                                  "sk-" + "a" * 24, "AKIA" + "B" * 16, "ghp_" + "c" * 36,
                                                  "xoxb-1234567890ab", "AIza" + "d" * 35, "API_KEY = 'x" + "y" * 20,
                                                  "Password: " + "z" * 16, "VIAGRA", "casino bonus", "Cialis")
           for before in ("", " ", "x", "-", "+", "(", ".", "7", "é") for after in ("", " ", ".", "x", "-", "9")]


def test_rewritten_patterns_find_what_the_lookbehind_first_ones_did(principles):
    import re

    by_name = {p.name: p for p in principles}
    found = 0
    for name, sources in _LOOKBEHIND_FIRST.items():
        for detector, source in zip(by_name[name].detectors, sources, strict=True):
            reference = re.compile(source)
            for text in _TRICKY:
                expected = [(m.span(), m.group()) for m in reference.finditer(text)]
                assert [(m.span(), m.group()) for m in detector.pattern.finditer(text)] == expected, (name, text)
                found += bool(expected)
    assert found > 100  # the cases exercise matches, not only misses


def test_required_characters_skip_texts_that_cannot_match(principles):
    import re

    from ultrathink.data.constitution import Detector, required_chars

    assert required_chars(re.compile(r"(?<![\w.+-])[a-z]+@(?:[a-z]+\.)+[a-z]{2,}")) == "@."
    assert required_chars(re.compile(r"a?b*(?:c|d)(?=e)(?<!f)")) == ""  # optional, alternative, lookaround: none
    assert required_chars(re.compile(r"x{2}(y)", re.IGNORECASE)) == ""  # case-insensitive: either case may appear
    assert required_chars(re.compile(r"x(?i:y)z")) == "xz"
    email = {p.name: p for p in principles}["email"].detectors[0]
    assert email.needs == "@."
    texts = ["write to a.b@c.org now", "no at sign in a.b.c.org", "ab@cd", "x@y.zz and q@r.st"]
    for text in texts:  # the prefilter changes speed only, never the spans
        assert [m.group() for m in email.spans(text)] == [m.group() for m in email.pattern.finditer(text)]
    assert Detector(re.compile("b@"), None).spans("a b@ c") and not Detector(re.compile("b@"), None).can_match("b")


def test_cleaned_gate_flags_from_cleaning_equal_a_fresh_scan(tmp_path):
    """apply_constitution's violation columns (changed texts rescanned, the others carried) are exactly what a scan
    of the cleaned texts finds, including a redaction that creates a match of a later-checked principle."""
    path = tmp_path / "c.yaml"
    path.write_text("""
principles:
  - name: token
    action: redact
    placeholder: "darn"
    detectors: [{regex: 'tok_[0-9]+'}]
  - name: rude
    action: flag
    max_rate: 1.0
    detectors: [{words: [darn]}]
  - name: secret
    action: redact
    placeholder: "tok_1"
    detectors: [{regex: 'pw=[a-z]+'}]
""")
    principles = load_constitution(path)
    docs = ["a tok_12 here", "darn it", "pw=abc leaks", "clean", "tok_1 and pw=x", "tok_", "Darn tok_3"]
    cleaned, _ = apply_constitution(frame(docs), principles)
    carried = validate_cleaned(cleaned, principles, min_rows=1)
    scanned = validate_cleaned(cleaned[["text"]], principles, min_rows=1)
    assert carried.to_dict() == scanned.to_dict()
    from ultrathink.data.constitution import violation_column

    for p in principles:
        assert cleaned[violation_column(p.name)].tolist() == [p.matches(t) > 0 for t in cleaned["text"]]
    # "pw=abc" became "tok_1", which the token principle (applied earlier) now matches: the gate sees it
    assert cleaned[violation_column("token")].tolist() == [False, False, True, False, True, False, False]
    assert not carried.success
