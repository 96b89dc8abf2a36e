"""The arithmetic of the one yardstick: documents → packed tokens → next-token loss → bits per byte.

This module imports nothing else from ultrathink, on purpose: a registered model is scored under its own code (the
package snapshot MLflow logged with it, see ultrathink.text_eval), and that process loads this file by path next to
the snapshot's model classes. ultrathink.evaluate builds the stage's metrics and the Yardstick on top of it.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import torch


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


def bits_per_byte(loss_nats: float, n_tokens: int, n_bytes: int) -> float:
    """Tokenizer-independent: the code length of the text in bits, divided by its UTF-8 size."""
    return loss_nats * n_tokens / (math.log(2) * n_bytes)


def encode_documents(tokenizer, documents) -> torch.Tensor:
    """[EOS] + each document's ids followed by EOS: the packing of the prepare stage, with the EOS that precedes
    the first document so that its first token is predicted as every other document's is."""
    if not documents:
        raise ValueError("no documents: there is nothing to score")
    eos = tokenizer.eos_token_id
    ids = [eos]
    for encoding in tokenizer.backend_tokenizer.encode_batch_fast(list(documents), add_special_tokens=False):
        ids += encoding.ids
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


@torch.no_grad()
def mean_loss(model, batches, context=nullcontext) -> tuple[float, int]:
    """Mean next-token loss of `model(x, y) -> (logits, loss, ...)` over (x, y) batches, weighting each batch by
    its number of targets, and that number; `context()` wraps each forward (e.g. autocast). The loss is read by
    position: registered models are scored with the code they were trained with, old and new (text_eval.py)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for x, y in batches:
        with context():
            loss = model(x, y)[1]
        total += loss.item() * y.numel()
        count += y.numel()
    model.train(was_training)
    return total / max(count, 1), count


def windows(tokens: torch.Tensor, seq_len: int, batch_size: int):
    """(x, y) batches covering every next-token prediction once: full windows of seq_len in batches, then the
    ragged last window alone."""
    n_full = (len(tokens) - 1) // seq_len
    full = tokens[: n_full * seq_len + 1]
    starts = list(range(0, n_full * seq_len, seq_len))
    for i in range(0, len(starts), batch_size):
        rows = torch.stack([full[s : s + seq_len + 1] for s in starts[i : i + batch_size]])
        yield rows[:, :-1], rows[:, 1:]
    rest = tokens[n_full * seq_len :]
    if len(rest) > 1:
        yield rest[None, :-1], rest[None, 1:]


def score_stream(model, stream: torch.Tensor, n_bytes: int, n_documents: int, batch_size: int = 8,
                 context=nullcontext) -> TextScore:
    """Score every prediction of a packed token stream (see encode_documents) once, on the model's device."""
    device = next(model.parameters()).device
    batches = ((x.to(device), y.to(device)) for x, y in windows(stream, model.cfg.seq_len, batch_size))
    loss, predicted = mean_loss(model, batches, context)
    return TextScore(loss=loss, bits_per_byte=bits_per_byte(loss, predicted, n_bytes), perplexity=math.exp(loss),
                     tokens=predicted, bytes=n_bytes, documents=n_documents)


def score_documents(model, tokenizer, documents, batch_size: int = 8) -> TextScore:
    """Loss and bits per byte of `documents` under `model` and its own tokenizer."""
    stream = encode_documents(tokenizer, documents)
    return score_stream(model, stream, sum(len(d.encode("utf-8")) for d in documents), len(documents), batch_size)
