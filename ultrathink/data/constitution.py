"""The data constitution: principles a training corpus must respect, each with detectors and an action.

A YAML file (params `constitution.path`) lists principles in the order they apply:

    principles:
      - name: email
        action: redact            # redact: replace each match with `placeholder` (default <|name|>)
        detectors:                # drop: remove the whole document; flag: keep it, count it
          - regex: '[\\w.+-]+@[\\w-]+\\.[\\w.-]+'
      - name: credit_card
        action: redact
        detectors:
          - {regex: '\\d(?:[ -]?\\d){12,18}', check: luhn}   # a match counts only if its digits pass the check
      - name: spam
        action: drop
        max_rate: 0.0             # share of cleaned documents that may still match (the gate's threshold)
        detectors:
          - words: [viagra, casino bonus]                     # whole words or phrases, any case

Cleaning applies the actions; the validate gate then checks every detector on the cleaned corpus and fails when
more than `max_rate` of the documents still match a principle (always 0 after redact/drop, unless a placeholder or a
redaction creates a new match; for `flag` principles, the share of flagged documents). Texts that cleaning changed
are scanned again; the others keep what cleaning's scan found, which is the same scan of the same text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from re import _constants as sre, _parser as sre_parse
from pathlib import Path
from typing import Callable, Literal

import pandas as pd
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ultrathink.errors import StageError

TEXT = "text"
Action = Literal["redact", "drop", "flag"]


class ConstitutionError(StageError, ValueError):
    """The constitution file cannot be used; the message names the file and the principle."""


def luhn_valid(digits: str) -> bool:
    """The Luhn checksum that every payment card number satisfies: doubling every second digit from the right."""
    if not digits.isdigit():
        return False
    total = 0
    for position, char in enumerate(reversed(digits)):
        value = int(char) * (2 if position % 2 else 1)
        total += value - 9 if value > 9 else value
    return total % 10 == 0


def _card_number(match: str) -> bool:
    digits = re.sub(r"\D", "", match)
    return 13 <= len(digits) <= 19 and luhn_valid(digits)


CHECKS: dict[str, Callable[[str], bool]] = {"luhn": _card_number}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DetectorSpec(_Strict):
    regex: str | None = None
    words: list[str] | None = Field(None, min_length=1)
    ignore_case: bool = False
    check: Literal["luhn"] | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> "DetectorSpec":
        if (self.regex is None) == (self.words is None):
            raise ValueError("a detector has exactly one of 'regex' or 'words'")
        if self.check and self.regex is None:
            raise ValueError("'check' applies to regex detectors only")
        return self


class PrincipleSpec(_Strict):
    name: str = Field(..., pattern=r"^\w+$")
    description: str = ""
    action: Action
    placeholder: str | None = None
    max_rate: float = Field(0.0, ge=0, le=1)
    detectors: list[DetectorSpec] = Field(..., min_length=1)


class ConstitutionSpec(_Strict):
    principles: list[PrincipleSpec] = Field(..., min_length=1)

    @model_validator(mode="after")
    def _unique_names(self) -> "ConstitutionSpec":
        names = [p.name for p in self.principles]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"principle names must be unique; repeated: {', '.join(repeated)}")
        return self


@dataclass(frozen=True)
class Detector:
    pattern: re.Pattern
    check: Callable[[str], bool] | None = None
    # Characters every match contains (from the parsed pattern): a text lacking one cannot match, and `in` finds
    # that at memchr speed, where the regex scan runs at ~50 MB/s.
    needs: str = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "needs", required_chars(self.pattern))

    def can_match(self, text: str) -> bool:
        return all(char in text for char in self.needs)

    def spans(self, text: str) -> list[re.Match]:
        if not self.can_match(text):
            return []
        return [m for m in self.pattern.finditer(text) if self.check is None or self.check(m.group())]


def required_chars(pattern: re.Pattern) -> str:
    """Literal characters that every match of `pattern` contains: those of its top-level sequence, of groups in
    it and of repeats taken at least once (not alternatives, lookarounds or case-insensitive parts)."""
    if pattern.flags & re.IGNORECASE:
        return ""
    found: list[str] = []

    def walk(items) -> None:
        for op, arg in items:
            if op is sre.LITERAL:
                found.append(chr(arg))
            elif op is sre.SUBPATTERN and not arg[1] & re.IGNORECASE:  # (group, add_flags, del_flags, items)
                walk(arg[3])
            elif op in (sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT) and arg[0] >= 1:  # (min, max, items)
                walk(arg[2])

    walk(sre_parse.parse(pattern.pattern, pattern.flags))
    return "".join(dict.fromkeys(found))


@dataclass(frozen=True)
class Principle:
    name: str
    action: Action
    placeholder: str
    max_rate: float
    detectors: tuple[Detector, ...]

    def matches(self, text: str) -> int:
        """How many spans of `text` violate this principle."""
        return sum(len(d.spans(text)) for d in self.detectors)

    def redact(self, text: str) -> tuple[str, int]:
        """`text` with every violating span replaced by the placeholder, and how many were replaced."""
        total = 0
        for detector in self.detectors:
            if not detector.can_match(text):
                continue

            def replace(match: re.Match, check=detector.check) -> str:
                nonlocal total
                if check is not None and not check(match.group()):
                    return match.group()
                total += 1
                return self.placeholder
            text = detector.pattern.sub(replace, text)
        return text, total


def _compile(spec: DetectorSpec, where: str) -> Detector:
    flags = re.IGNORECASE if spec.ignore_case or spec.words else 0
    source = spec.regex if spec.regex is not None else _words_pattern(spec.words)
    try:
        pattern = re.compile(source, flags)
    except re.error as exc:
        raise ConstitutionError(f"{where}: invalid regex {spec.regex!r}: {exc}") from None
    return Detector(pattern, CHECKS[spec.check] if spec.check else None)


def _words_pattern(words: list[str]) -> str:
    """Whole words or phrases, any case, longest first. The lookahead on their first letters comes first: `re`
    then skips to candidate positions, where a leading lookbehind makes it try every position (43 → 55 MB/s)."""
    firsts = "".join(sorted({c for w in words for c in (w[0].lower(), w[0].upper())}))
    alternatives = "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True))
    return f"(?=[{re.escape(firsts)}])(?<!\\w)(?:{alternatives})(?!\\w)"


def load_constitution(path: str | Path) -> list[Principle]:
    """The principles of a constitution file, compiled; a missing file, bad YAML or a bad regex names the file."""
    path = Path(path)
    if not path.is_file():
        raise ConstitutionError(f"constitution file not found: {path} (constitution.path)")
    try:
        spec = ConstitutionSpec.model_validate(yaml.safe_load(path.read_text(encoding="utf-8")))
    except yaml.YAMLError as exc:
        raise ConstitutionError(f"{path}: not valid YAML: {exc}") from None
    except ValidationError as exc:
        lines = "\n".join(f"  - {'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise ConstitutionError(f"{path}: invalid constitution\n{lines}") from None
    return [
        Principle(p.name, p.action, p.placeholder or f"<|{p.name}|>", p.max_rate,
                  tuple(_compile(d, f"{path}: principle {p.name!r}") for d in p.detectors))
        for p in spec.principles
    ]


def apply_constitution(corpus: pd.DataFrame, principles: list[Principle]) -> tuple[pd.DataFrame, dict]:
    """Apply each principle in order (redact, drop or flag) to the "text" column; count what each one did.

    Per principle: action, documents (that matched it), matches (spans found) and, by action, redactions or
    documents_dropped or documents_flagged. The cleaned corpus gets a `violation_column` per principle: whether the
    final text still matches it (what the cleaned gate checks). A text that no principle changed was scanned by
    every principle as it finally is, so its flags are those counts; only changed texts are scanned again.
    """
    texts = corpus[TEXT].tolist()
    keep = [True] * len(texts)
    changed = [False] * len(texts)
    found_by = {principle.name: [0] * len(texts) for principle in principles}
    counts = {}
    for principle in principles:
        stats = {"action": principle.action, "documents": 0, "matches": 0}
        found_here = found_by[principle.name]
        for row, text in enumerate(texts):
            if not keep[row]:
                continue
            if principle.action == "redact":
                texts[row], found = principle.redact(text)
                changed[row] |= texts[row] != text
            else:
                found = principle.matches(text)
                keep[row] = not (found and principle.action == "drop")
            found_here[row] = found
            stats["documents"] += bool(found)
            stats["matches"] += found
        stats[{"redact": "redactions", "drop": "documents_dropped", "flag": "documents_flagged"}[principle.action]] = (
            stats["matches"] if principle.action == "redact" else stats["documents"])
        counts[principle.name] = stats
    violations = {
        violation_column(principle.name): [
            (principle.matches(text) if was_changed and kept else found) > 0
            for text, kept, was_changed, found in zip(texts, keep, changed, found_by[principle.name])]
        for principle in principles}
    cleaned = corpus.assign(**{TEXT: pd.Series(texts, index=corpus.index, dtype=object)},
                            **{name: pd.Series(flags, index=corpus.index, dtype=bool)
                               for name, flags in violations.items()})
    cleaned = cleaned[pd.Series(keep, index=corpus.index, dtype=bool)]  # a Series: rows, even when there are none
    return cleaned.reset_index(drop=True), counts


def violation_column(name: str) -> str:
    """The cleaned corpus's column saying whether a text still matches principle `name`."""
    return f"violates_{name}"
