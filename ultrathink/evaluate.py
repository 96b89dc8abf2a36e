"""The one yardstick: every bits-per-byte the project reports comes from `score_documents` / `score_stream`.

text → documents (split as the data loader splits them) → the model's own tokens, packed as training packs them
([EOS] doc₁ [EOS] doc₂ [EOS] …) → next-token loss on every token after the first (each document's tokens and the EOS
that ends it), in non-overlapping windows of seq_len → nats → bits over every UTF-8 byte of the documents. The
evaluate stage, `ultrathink eval` and promotion all call these, so two numbers are comparable whenever their
documents are the same; promotion compares two models only on one text, whose sha256 it records.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass

import numpy as np
import torch

from ultrathink.config import EvaluateConfig
from ultrathink.model import UltraThink
from ultrathink.model.generate import generate_text
from ultrathink.train.trainer import mean_loss


@dataclass
class TextScore:
    loss: float  # mean next-token loss in nats over the scored tokens
    bits_per_byte: float
    perplexity: float
    tokens: int  # tokens predicted: every document token and each document's closing EOS
    bytes: int  # UTF-8 bytes of the documents
    documents: int

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Yardstick:
    """A text that models are compared on: its documents, and the sha256 and size that name it in a record."""

    documents: tuple[str, ...]

    def jsonl(self) -> str:
        return "".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in self.documents)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.jsonl().encode("utf-8")).hexdigest()

    @property
    def bytes(self) -> int:
        return sum(len(d.encode("utf-8")) for d in self.documents)

    def describe(self) -> dict:
        return {"sha256": self.sha256, "bytes": self.bytes, "documents": len(self.documents)}


def bits_per_byte(loss_nats: float, n_tokens: int, n_bytes: int) -> float:
    """Tokenizer-independent: the code length of the text in bits, divided by its UTF-8 size."""
    return loss_nats * n_tokens / (math.log(2) * n_bytes)


def encode_documents(tokenizer, documents: list[str] | tuple[str, ...]) -> torch.Tensor:
    """[EOS] + each document's ids followed by EOS: the packing of the prepare stage, with the EOS that precedes
    the first document so that its first token is predicted as every other document's is."""
    if not documents:
        raise ValueError("no documents: there is nothing to score")
    eos = tokenizer.eos_token_id
    encodings = tokenizer.backend_tokenizer.encode_batch_fast(list(documents), add_special_tokens=False)
    ids = [eos]
    for encoding in encodings:
        ids += encoding.ids
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def score_stream(model: UltraThink, stream: torch.Tensor, n_bytes: int, n_documents: int, batch_size: int = 8,
                 precision: str = "fp32") -> TextScore:
    """Score every prediction of a packed token stream (see encode_documents) once."""
    loss, predicted = mean_loss(model, _windows(stream, model.cfg.seq_len, batch_size), precision)
    return TextScore(loss=loss, bits_per_byte=bits_per_byte(loss, predicted, n_bytes), perplexity=math.exp(loss),
                     tokens=predicted, bytes=n_bytes, documents=n_documents)


def score_documents(model: UltraThink, tokenizer, documents: list[str] | tuple[str, ...],
                    batch_size: int = 8) -> TextScore:
    """Loss and bits per byte of `documents` under `model` and its own tokenizer."""
    stream = encode_documents(tokenizer, documents)
    return score_stream(model, stream, sum(len(d.encode("utf-8")) for d in documents), len(documents), batch_size)


def _windows(tokens: torch.Tensor, seq_len: int, batch_size: int):
    """(x, y) batches covering every next-token prediction once: full windows of seq_len in batches, then the
    ragged last window alone (mean_loss weights each batch by its number of targets)."""
    n_full = (len(tokens) - 1) // seq_len
    full = tokens[: n_full * seq_len + 1]
    starts = list(range(0, n_full * seq_len, seq_len))
    for i in range(0, len(starts), batch_size):
        rows = torch.stack([full[s : s + seq_len + 1] for s in starts[i : i + batch_size]])
        yield rows[:, :-1], rows[:, 1:]
    rest = tokens[n_full * seq_len :]
    if len(rest) > 1:
        yield rest[None, :-1], rest[None, 1:]


def unigram_cross_entropy(train_tokens: np.ndarray, val_tokens: np.ndarray, vocab_size: int) -> float:
    """Loss (nats/token) on val of a model that knows only train's token frequencies (add-one smoothed): the
    floor any model that uses context has to beat."""
    counts = np.bincount(train_tokens, minlength=vocab_size).astype(np.float64) + 1.0
    log_probs = np.log(counts / counts.sum())
    return float(-log_probs[np.asarray(val_tokens)].mean())


def sample_generations(model: UltraThink, tokenizer, cfg: EvaluateConfig) -> list[dict[str, str]]:
    """For each prompt, the greedy continuation and one sampled with the configured temperature and top-k."""
    def complete(prompt: str, temperature: float) -> str:
        return generate_text(model, tokenizer, prompt, cfg.max_new_tokens, temperature, cfg.top_k, cfg.seed)

    return [{"prompt": p, "greedy": complete(p, 0.0), "sampled": complete(p, cfg.temperature)} for p in cfg.prompts]
