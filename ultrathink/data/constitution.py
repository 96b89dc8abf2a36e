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

Cleaning applies the actions; the validate gate then re-runs every detector on the cleaned corpus and fails when more
than `max_rate` of the documents still match a principle (always 0 after redact/drop, unless a placeholder or a
redaction creates a new match; for `flag` principles, the share of flagged documents).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
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

    def spans(self, text: str) -> list[re.Match]:
        return [m for m in self.pattern.finditer(text) if self.check is None or self.check(m.group())]


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
    source = spec.regex if spec.regex is not None else (
        r"(?<!\w)(?:" + "|".join(re.escape(w) for w in sorted(spec.words, key=len, reverse=True)) + r")(?!\w)")
    try:
        pattern = re.compile(source, flags)
    except re.error as exc:
        raise ConstitutionError(f"{where}: invalid regex {spec.regex!r}: {exc}") from None
    return Detector(pattern, CHECKS[spec.check] if spec.check else None)


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
    documents_dropped or documents_flagged.
    """
    texts = corpus[TEXT].tolist()
    keep = [True] * len(texts)
    counts = {}
    for principle in principles:
        stats = {"action": principle.action, "documents": 0, "matches": 0}
        for row, text in enumerate(texts):
            if not keep[row]:
                continue
            if principle.action == "redact":
                texts[row], found = principle.redact(text)
            else:
                found = principle.matches(text)
                keep[row] = not (found and principle.action == "drop")
            stats["documents"] += bool(found)
            stats["matches"] += found
        stats[{"redact": "redactions", "drop": "documents_dropped", "flag": "documents_flagged"}[principle.action]] = (
            stats["matches"] if principle.action == "redact" else stats["documents"])
        counts[principle.name] = stats
    cleaned = corpus.assign(**{TEXT: pd.Series(texts, index=corpus.index, dtype=object)})
    cleaned = cleaned[pd.Series(keep, index=corpus.index, dtype=bool)]  # a Series: rows, even when there are none
    return cleaned.reset_index(drop=True), counts
