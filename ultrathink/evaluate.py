"""The one yardstick: every bits-per-byte the project reports comes from `score_documents` / `score_stream`
(ultrathink.scoring, re-exported here).

text → documents (split as the data loader splits them) → the model's own tokens, packed as training packs them
([EOS] doc₁ [EOS] doc₂ [EOS] …) → next-token loss on every token after the first (each document's tokens and the EOS
that ends it), in non-overlapping windows of seq_len → nats → bits over every UTF-8 byte of the documents. The
evaluate stage, `ultrathink eval` and promotion all call these, so two numbers are comparable whenever their
documents are the same; promotion compares two models only on one text, whose sha256 it records.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ultrathink.config import EvaluateConfig
from ultrathink.model import UltraThink
from ultrathink.model.generate import generate_text
from ultrathink.scoring import (TextScore, answer_bytes, bits_per_byte, encode_documents, score_documents,  # noqa: F401
                                score_stream)
from ultrathink.text_eval import ModelFiles, score_model, score_pairs


@dataclass(frozen=True)
class Yardstick:
    """A text that models are compared on: its documents, and the sha256 and size that name it in a record."""

    documents: tuple[str, ...]
    metric: ClassVar[str] = "val_bpb"

    def jsonl(self) -> str:
        return "".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in self.documents)

    def score(self, files: ModelFiles, device=None) -> float:
        """Bits per byte of the text under a model (under its own code when it is a registered one), run on
        `device` (None or "auto": the GPU when there is one)."""
        return score_model(files, self.documents, device=device).bits_per_byte

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.jsonl().encode("utf-8")).hexdigest()

    @property
    def bytes(self) -> int:
        return sum(len(d.encode("utf-8")) for d in self.documents)

    def describe(self) -> dict:
        return {"sha256": self.sha256, "bytes": self.bytes, "documents": len(self.documents)}


@dataclass(frozen=True)
class ChatYardstick(Yardstick):
    """Held-out chats that fine-tuned models are compared on: bits per byte of the answers only (each model under
    its own chat tokenizer). `documents` are the chats' messages lists."""

    documents: tuple[tuple[dict, ...], ...]
    metric: ClassVar[str] = "heldout_response_bpb"

    def jsonl(self) -> str:
        return "".join(json.dumps({"messages": list(c)}, ensure_ascii=False) + "\n" for c in self.documents)

    def score(self, files: ModelFiles, device=None) -> float:
        return score_model(files, self.documents, chats=True, device=device).bits_per_byte

    @property
    def bytes(self) -> int:
        return answer_bytes(self.documents)


@dataclass(frozen=True)
class PreferenceYardstick(Yardstick):
    """Held-out preference pairs that aligned models are compared on: how well each model's own likelihoods rank
    the chosen answer above the rejected one (scoring.PreferenceScore.loss_bits, lower is better), with no
    reference model, so models aligned from different bases compare. `documents` are the pairs {prompt: [messages],
    chosen, rejected}."""

    documents: tuple[dict, ...]
    metric: ClassVar[str] = "heldout_preference_bits"

    def jsonl(self) -> str:
        return "".join(json.dumps(p, ensure_ascii=False) + "\n" for p in self.documents)

    def score(self, files: ModelFiles, device=None) -> float:
        return score_pairs(files, self.documents, device=device).loss_bits

    @property
    def bytes(self) -> int:
        return sum(len(p[k].encode("utf-8")) for p in self.documents for k in ("chosen", "rejected"))


def read_yardstick(jsonl: str) -> Yardstick:
    """A yardstick from its JSON lines (as logged with a registered version): texts, chats, or preference pairs."""
    rows = [json.loads(line) for line in jsonl.splitlines() if line.strip()]
    if rows and "chosen" in rows[0]:
        return PreferenceYardstick(tuple(rows))
    if rows and "messages" in rows[0]:
        return ChatYardstick(tuple(tuple(r["messages"]) for r in rows))
    return Yardstick(tuple(r["text"] for r in rows))


def unigram_cross_entropy(train_tokens: np.ndarray, val_tokens: np.ndarray, vocab_size: int) -> float:
    """Loss (nats/token) on val of a model that knows only train's token frequencies (add-one smoothed): the
    floor any model that uses context has to beat."""
    counts = np.ones(vocab_size, dtype=np.float64)
    for start in range(0, len(train_tokens), 1 << 24):  # a chunk at a time: the train split may exceed memory
        counts += np.bincount(np.asarray(train_tokens[start : start + (1 << 24)]), minlength=vocab_size)
    log_probs = np.log(counts / counts.sum())
    return float(-log_probs[np.asarray(val_tokens)].mean())


def sample_generations(model: UltraThink, tokenizer, cfg: EvaluateConfig, device=None) -> list[dict[str, str]]:
    """For each prompt, the greedy continuation and one sampled with the configured temperature, top-k and top-p,
    on `device` (the model is moved there) or, when None, on the model's device."""
    def complete(prompt: str, temperature: float) -> str:
        return generate_text(model, tokenizer, prompt, cfg.max_new_tokens, temperature, cfg.top_k, cfg.seed,
                             cfg.top_p, device)

    return [{"prompt": p, "greedy": complete(p, 0.0), "sampled": complete(p, cfg.temperature)} for p in cfg.prompts]
