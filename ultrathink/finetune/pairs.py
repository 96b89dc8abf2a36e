"""Prompt/response pairs for fine-tuning: read (a JSONL file, or the embedded default), checked row by row for the
gate, split into train and held-out pairs, and served to the Trainer as padded chat rows with answer-only targets.

A JSONL row is either {prompt_field: str, response_field: str} or {messages_field: [{role, content}, ...]} ending
with an assistant message. The embedded default asks about each section of the Python language reference that
pretraining reads (`What does the Python language reference say about the "for" statement?`) and answers with the
section's first prose sentences.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import torch

from ultrathink.config import FinetuneConfig
from ultrathink.data.reference import reference_topics
from ultrathink.errors import StageError
from ultrathink.model.chat import ROLES, assistant, user
from ultrathink.scoring import chat_rows
from ultrathink.train.loader import BatchLayout, OrderedBatches

EMBEDDED = "embedded"
PROMPT, RESPONSE, MESSAGES, PROBLEM, LINE = "prompt", "response", "messages", "problem", "line"
MAX_EMBEDDED_ANSWER_CHARS = 240  # fits a default 128-token context with its question
QUESTIONS = ("What does the Python language reference say about {}?", "Explain {} in Python.", "Tell me about {}.")
_UNDERLINE = re.compile(r"^([*=\-~^])\1{3,}$")
_SENTENCE_END = re.compile(r"(?<=[.:;!?])\s")


class PairsError(StageError):
    """The pairs file cannot be read; the message names the file and line."""


def load_pairs(cfg: FinetuneConfig, root: Path = Path(".")) -> pd.DataFrame:
    """One row per pair: prompt and response text (None when missing), the chat's messages, a `problem` (None,
    or why the row is not a well-formed pair) for the gate to count, and the file's line number."""
    rows = embedded_pairs() if cfg.data == EMBEDDED else read_jsonl(root / cfg.data, cfg)
    return pd.DataFrame(rows, columns=[PROMPT, RESPONSE, MESSAGES, PROBLEM, LINE]).astype({LINE: object})


def read_jsonl(path: Path, cfg: FinetuneConfig) -> list[dict]:
    return [{**pair_row(record, cfg), LINE: number}
            for number, record in json_objects(path, "finetune.data", "a .jsonl of pairs", PairsError)]


def json_objects(path: Path, knob: str, what: str, error: type[StageError]) -> Iterator[tuple[int, dict]]:
    """(line number, object) of each non-blank line of a JSONL file; `error` names the file and the line that is
    not a JSON object, or `knob` when there is no such file."""
    if not path.is_file():
        raise error(f"{knob}: {path} is not a file ({what}, or `embedded`)")
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise error(f"{path} line {number}: not JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(record, dict):
                raise error(f"{path} line {number}: expected a JSON object, got {type(record).__name__}")
            yield number, record


def pair_row(record: dict, cfg: FinetuneConfig) -> dict:
    """A JSONL record as a row: prompt/response fields, or a chat under messages_field."""
    if cfg.messages_field in record:
        messages = record[cfg.messages_field]
        problem = chat_problem(messages)
        if problem:
            return {PROMPT: None, RESPONSE: None, MESSAGES: None, PROBLEM: problem}
        prompt = "\n".join(m["content"] for m in messages[:-1])
        return {PROMPT: prompt, RESPONSE: messages[-1]["content"], MESSAGES: messages, PROBLEM: None}
    prompt, response = record.get(cfg.prompt_field), record.get(cfg.response_field)
    wrong = [f"{name} is {type(value).__name__}, not text" for name, value in
             ((cfg.prompt_field, prompt), (cfg.response_field, response)) if value is not None and not isinstance(value, str)]
    if wrong:
        return {PROMPT: None, RESPONSE: None, MESSAGES: None, PROBLEM: "; ".join(wrong)}
    messages = [user(prompt), assistant(response)] if prompt is not None and response is not None else None
    return {PROMPT: prompt, RESPONSE: response, MESSAGES: messages, PROBLEM: None}


def chat_problem(messages) -> str | None:
    if not isinstance(messages, list) or not messages:
        return "messages is not a non-empty list"
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            return f"message {i} is not {{role: {'|'.join(ROLES)}, content: text}}"
    if messages[-1]["role"] != "assistant":
        return "the last message is not the assistant's"
    if not any(m["role"] == "user" for m in messages):
        return "no user message"
    return None


def embedded_pairs() -> list[dict]:
    """Questions about the sections of the Python language reference (ultrathink.data.reference), each answered
    with the section's first prose sentences; two phrasings per section."""
    topics = reference_topics()
    rows = []
    sections = [s for name in sorted(topics) for s in reference_sections(topics[name])]
    for i, (title, answer) in enumerate(sections):
        subject = title[0].lower() + title[1:] if title[1:2].islower() else title  # not an acronym's capital
        for question in (QUESTIONS[i % 3], QUESTIONS[(i + 1) % 3]):
            prompt = question.format(subject)
            rows.append({PROMPT: prompt, RESPONSE: answer, MESSAGES: [user(prompt), assistant(answer)],
                         PROBLEM: None})
    return rows


def reference_sections(text: str) -> list[tuple[str, str]]:
    """(title, answer) for each underlined section title that a prose paragraph follows."""
    lines = text.split("\n")
    found = []
    for i in range(1, len(lines)):
        title = lines[i - 1].strip()
        if not (_UNDERLINE.match(lines[i]) and len(lines[i]) == len(lines[i - 1].rstrip()) and title):
            continue
        for paragraph in "\n".join(lines[i + 1 :]).split("\n\n"):
            if _UNDERLINE.match(paragraph.strip().split("\n")[-1]):
                break  # the next section began: this one has no prose of its own
            if paragraph.startswith((" ", "\t")) or "::=" in paragraph or not paragraph.strip():
                continue  # grammar and code blocks are indented
            answer = first_sentences(" ".join(paragraph.split()), MAX_EMBEDDED_ANSWER_CHARS)
            if answer:
                found.append((title, answer[:-1] + "." if answer.endswith(":") else answer))  # ":" led to code
            break
    return found


def first_sentences(text: str, limit: int) -> str | None:
    """The longest run of whole sentences of `text` within `limit` characters (None if even the first is longer)."""
    if len(text) <= limit:
        return text
    ends = [m.start() for m in _SENTENCE_END.finditer(text) if m.start() <= limit]
    return text[: ends[-1]] if ends else None


def split_pairs(frame: pd.DataFrame, val_fraction: float) -> tuple[list[list[dict]], list[list[dict]]]:
    """(train chats, held-out chats), split by a hash of the answer: pairs that share an answer (two phrasings of
    one question) stay on one side, and a pair keeps its side when others are added."""
    train, val = [], []
    for messages in frame[MESSAGES]:
        digest = hashlib.sha256(messages[-1]["content"].encode("utf-8")).digest()
        (val if int.from_bytes(digest[:8], "big") / 2**64 < val_fraction else train).append(messages)
    if not train or not val:
        raise StageError(f"finetune.val_fraction={val_fraction} leaves {len(train)} training and {len(val)} "
                         f"held-out pairs; both need at least one")
    return train, val


def chats_jsonl(chats: list[list[dict]]) -> str:
    return "".join(json.dumps({MESSAGES: c}, ensure_ascii=False) + "\n" for c in chats)


def read_chats(path: Path) -> list[list[dict]]:
    return [json.loads(line)[MESSAGES] for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


class ChatBatches(OrderedBatches):
    """Padded chat rows in a seeded order per epoch, for the Trainer: next() gives (x, y) with y IGNORE outside
    the answers; the position is (seed, epoch, position), so a resumed run reads the same batches."""

    def __init__(self, tokenizer, chats: list[list[dict]], seq_len: int, batch_size: int, seed: int, rank: int = 0,
                 world_size: int = 1):
        self.x, self.y, _ = chat_rows(tokenizer, chats, seq_len + 1)
        self.seq_len = seq_len
        size = min(batch_size, len(chats))
        knobs = (f"finetune.batch_size {batch_size}" if size == batch_size
                 else f"{len(chats)} training pairs, fewer than finetune.batch_size {batch_size}")
        layout = BatchLayout.split(size, 1, world_size, knobs)
        self._start_order(len(self.x), seed, True, layout, rank)

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.from_numpy(self.next_rows())
        return self.x[rows], self.y[rows]


class ChatEval:
    """Held-out chats for the Trainer's validation: every row, in order, answer tokens only."""

    def __init__(self, tokenizer, chats: list[list[dict]], seq_len: int):
        self.x, self.y, _ = chat_rows(tokenizer, chats, seq_len + 1)

    def eval_batches(self, batch_size: int, max_batches: int | None = None):
        for n, i in enumerate(range(0, len(self.x), batch_size)):
            if max_batches is not None and n >= max_batches:
                return
            yield self.x[i : i + batch_size], self.y[i : i + batch_size]
