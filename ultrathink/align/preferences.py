"""Preference pairs for alignment: read (a JSONL file, or the embedded default), checked row by row for the gate,
split into train and held-out pairs, and served to the Trainer as padded chosen/rejected rows.

A pair is {prompt: [messages before the answer], chosen: text, rejected: text}. A JSONL row gives it as
  - {prompt_field: text or messages, chosen_field: text, rejected_field: text}, or
  - {prompt_field: ..., chosen_field: [assistant message], rejected_field: [assistant message]}, or
  - {chosen_field: chat, rejected_field: chat}: two whole chats that share every message but their last, an
    assistant's (TRL's conversational form with an implicit prompt).

The embedded default asks the fine-tuning questions (ultrathink.finetune.pairs: about each section of the Python
language reference) and prefers the section's own answer to another section's (embedded_preferences). It teaches
the model to answer the question asked rather than a fluent answer about something else — relevance; it cannot
teach style, helpfulness, refusal or any judgement a human would add.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pandas as pd

from ultrathink.config import AlignConfig
from ultrathink.errors import StageError
from ultrathink.finetune.pairs import chat_problem, embedded_pairs, json_objects
from ultrathink.model.chat import user

EMBEDDED = "embedded"
PROMPT, CHOSEN, REJECTED, PROBLEM, LINE = "prompt", "chosen", "rejected", "problem", "line"
COLUMNS = [PROMPT, CHOSEN, REJECTED, PROBLEM, LINE]


class PreferencesError(StageError):
    """The preference file cannot be read; the message names the file and line."""


def load_preferences(cfg: AlignConfig, root: Path = Path(".")) -> pd.DataFrame:
    """One row per pair: the prompt's messages, the chosen and rejected answers' text (None when missing), a
    `problem` (None, or why the row is not a well-formed pair) for the gate to count, and the file's line."""
    rows = embedded_preferences(cfg.val_fraction) if cfg.data == EMBEDDED else read_jsonl(root / cfg.data, cfg)
    return pd.DataFrame(rows, columns=COLUMNS).astype({LINE: object})


def read_jsonl(path: Path, cfg: AlignConfig) -> list[dict]:
    return [{**preference_row(record, cfg), LINE: number}
            for number, record in json_objects(path, "align.data", "a .jsonl of preference pairs", PreferencesError)]


def preference_row(record: dict, cfg: AlignConfig) -> dict:
    """A JSONL record as a row (see the module's docstring for the three forms)."""
    chosen, rejected = record.get(cfg.chosen_field), record.get(cfg.rejected_field)
    if cfg.prompt_field not in record and isinstance(chosen, list) and isinstance(rejected, list):
        problem = chat_problem(chosen) or chat_problem(rejected)
        if problem:
            return _malformed(f"{cfg.chosen_field}/{cfg.rejected_field}: {problem}")
        if chosen[:-1] != rejected[:-1]:
            return _malformed(f"{cfg.chosen_field} and {cfg.rejected_field} differ before their last message "
                              "(a shared prompt is needed)")
        return {PROMPT: chosen[:-1], CHOSEN: chosen[-1]["content"], REJECTED: rejected[-1]["content"], PROBLEM: None}
    prompt = record.get(cfg.prompt_field)
    if isinstance(prompt, str):
        prompt = [user(prompt)]
    elif isinstance(prompt, list):
        problem = chat_problem([*prompt, {"role": "assistant", "content": ""}])
        if problem:
            return _malformed(f"{cfg.prompt_field}: {problem}")
    elif prompt is not None:
        return _malformed(f"{cfg.prompt_field} is {type(prompt).__name__}, not text or messages")
    answers = {}
    for field, value in ((cfg.chosen_field, chosen), (cfg.rejected_field, rejected)):
        if isinstance(value, list):  # [assistant message]
            if len(value) != 1 or not isinstance(value[0], dict) or value[0].get("role") != "assistant":
                return _malformed(f"{field} is a list but not one assistant message")
            value = value[0].get("content")
        if value is not None and not isinstance(value, str):
            return _malformed(f"{field} is {type(value).__name__}, not text")
        answers[field] = value
    return {PROMPT: prompt, CHOSEN: answers[cfg.chosen_field], REJECTED: answers[cfg.rejected_field], PROBLEM: None}


def _malformed(problem: str) -> dict:
    return {PROMPT: None, CHOSEN: None, REJECTED: None, PROBLEM: problem}


def embedded_preferences(val_fraction: float) -> list[dict]:
    """Each fine-tuning question (both phrasings) with its section's answer chosen over the answer of the question
    half its side of the split away (split_preferences's side: training or held out), or the next one with another
    answer. Every answer is rejected as often as it is chosen, on its own side, so an answer's own likelihood
    cancels out and only its fit to the question is left to learn; and no held-out pair's answer is trained on, as
    chosen or as rejected."""
    pairs = embedded_pairs()
    sides: dict[bool, list[str]] = {True: [], False: []}
    for pair in pairs:
        sides[is_held_out(pair["response"], val_fraction)].append(pair["response"])
    rows, seen = [], {True: 0, False: 0}
    for pair in pairs:
        side = is_held_out(pair["response"], val_fraction)
        answers, i = sides[side], seen[side]
        seen[side] += 1
        offset = len(answers) // 2
        while answers[(i + offset) % len(answers)] == pair["response"]:
            offset += 1
        rows.append({PROMPT: [user(pair["prompt"])], CHOSEN: pair["response"],
                     REJECTED: answers[(i + offset) % len(answers)], PROBLEM: None})
    return rows


def is_held_out(chosen: str, val_fraction: float) -> bool:
    """A pair's side of the split, by a hash of its chosen answer — fine-tuning's rule (finetune.pairs)."""
    digest = hashlib.sha256(chosen.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < val_fraction


def split_preferences(frame: pd.DataFrame, val_fraction: float) -> tuple[list[dict], list[dict]]:
    """(train pairs, held-out pairs), split by a hash of the chosen answer — fine-tuning's split (finetune.pairs):
    pairs that share an answer stay on one side, and the pairs fine-tuning held out are held out here too (at
    align.val_fraction ≥ finetune.val_fraction)."""
    train, val = [], []
    for prompt, chosen, rejected in zip(frame[PROMPT], frame[CHOSEN], frame[REJECTED]):
        pair = {PROMPT: list(prompt), CHOSEN: chosen, REJECTED: rejected}
        (val if is_held_out(chosen, val_fraction) else train).append(pair)
    if not train or not val:
        raise StageError(f"align.val_fraction={val_fraction} leaves {len(train)} training and {len(val)} held-out "
                         "pairs; both need at least one")
    return train, val


def pairs_jsonl(pairs: list[dict]) -> str:
    return "".join(json.dumps(p, ensure_ascii=False) + "\n" for p in pairs)


def read_pairs(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
