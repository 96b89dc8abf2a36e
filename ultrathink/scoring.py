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

IGNORE = -100  # a target the loss skips (torch's cross_entropy default ignore_index)


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


def document_prefix(tokenizer) -> list[int]:
    """The ids a tokenizer puts before every text it encodes: a Llama-style BOS, nothing for ours. Every document
    of a packed stream starts with them, as the model saw (or, for an open model, was trained on) documents."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    framed = tokenizer("a")["input_ids"]
    for start in range(len(framed) - len(plain) + 1):
        if framed[start : start + len(plain)] == plain:
            return framed[:start]
    return []


def encode_documents(tokenizer, documents) -> torch.Tensor:
    """[EOS] + each document's ids (after the tokenizer's prefix) followed by EOS: the packing of the prepare
    stage, with the EOS that precedes the first document so that its first token is predicted as every other
    document's is. On the CPU: the scorers put it on the model's device."""
    if not documents:
        raise ValueError("no documents: there is nothing to score")
    eos, prefix = tokenizer.eos_token_id, document_prefix(tokenizer)
    ids = [eos]
    for encoding in tokenizer.backend_tokenizer.encode_batch_fast(list(documents), add_special_tokens=False):
        ids += prefix + encoding.ids
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long, device="cpu")


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
        scored = int((y != IGNORE).sum())  # masked targets (a chat's prompt tokens, padding) are not predictions
        total += loss.item() * scored
        count += scored
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
    stream = stream.to(next(model.parameters()).device)
    batches = windows(stream, model.cfg.seq_len, batch_size)
    loss, predicted = mean_loss(model, batches, context)
    return TextScore(loss=loss, bits_per_byte=bits_per_byte(loss, predicted, n_bytes), perplexity=math.exp(loss),
                     tokens=predicted, bytes=n_bytes, documents=n_documents)


def score_documents(model, tokenizer, documents, batch_size: int = 8) -> TextScore:
    """Loss and bits per byte of `documents` under `model` and its own tokenizer."""
    stream = encode_documents(tokenizer, documents)
    return score_stream(model, stream, sum(len(d.encode("utf-8")) for d in documents), len(documents), batch_size)


# ---- chats: the loss on the answers only -------------------------------------------------------------------------
def render_chat(tokenizer, messages, add_generation_prompt: bool = False) -> list[int]:
    """A chat's token ids under the tokenizer's own chat template (the one `AutoTokenizer.apply_chat_template`
    uses), with every turn-closing EOS as the EOS id."""
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_conversation(tokenizer, messages) -> tuple[list[int], list[bool]]:
    """(ids, answer): the chat's ids and, per id, whether it belongs to an assistant turn (its text and the EOS that
    closes it, not what the template writes after that EOS): the tokens the loss is taken on. An assistant turn's
    ids are those that rendering the chat up to and including it adds to rendering the chat before it with the
    generation prompt (the assistant's header)."""
    ids = render_chat(tokenizer, messages)
    answer = [False] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(render_chat(tokenizer, messages[:i], add_generation_prompt=True))
        through = render_chat(tokenizer, messages[: i + 1])
        closing = [j for j in range(start, len(through)) if through[j] == tokenizer.eos_token_id]
        if ids[: len(through)] != through or not closing:
            raise ValueError("the tokenizer's chat template does not close each turn with the EOS token, or its "
                             "special tokens are split as text (a chat tokenizer: ultrathink.model.chat)")
        end = closing[-1] + 1  # what a template writes after the closing EOS (Qwen's newline) is not the answer
        answer[start:end] = [True] * (end - start)
    return ids, answer


def fit_window(ids: list[int], answer: list[bool], window: int) -> tuple[list[int], list[bool]]:
    """At most `window` ids of a chat: when too long, the prompt loses its first tokens (as generation crops a
    prompt) so that the last answer fits; an answer too long even then keeps half the window of what precedes it
    and loses its end."""
    if len(ids) <= window:
        return ids, answer
    last = len(answer) - answer[::-1].index(False) if True in answer else len(ids)  # where the last answer starts
    start = max(0, min(len(ids) - window, last - window // 2))
    return ids[start : start + window], answer[start : start + window]


def chat_rows(tokenizer, conversations, window: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(x, y, answer bytes): x and y of shape (N, window - 1), each chat fitted to the window and padded (with the
    pad token, or EOS for a tokenizer without one, as Llama's: padded inputs come after every target), y IGNORE
    except on answer tokens; and the UTF-8 bytes of the answer text those targets spell (a cropped answer counts
    only what was kept). On the CPU: the scorers put them on the model's device."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    xs, ys, n_bytes = [], [], 0
    for messages in conversations:
        ids, answer = fit_window(*encode_conversation(tokenizer, messages), window)
        pad = window - len(ids)
        targets = [t if keep else IGNORE for t, keep in zip(ids[1:], answer[1:])]
        xs.append(ids[:-1] + [pad_id] * pad)
        ys.append(targets + [IGNORE] * pad)
        spelled = [t for t in targets if t not in (IGNORE, tokenizer.eos_token_id)]
        n_bytes += len(tokenizer.decode(spelled).encode("utf-8"))
    return (torch.tensor(xs, dtype=torch.long, device="cpu"), torch.tensor(ys, dtype=torch.long, device="cpu"),
            n_bytes)


def answer_bytes(conversations) -> int:
    """UTF-8 bytes of the chats' assistant messages."""
    return sum(len(m["content"].encode("utf-8")) for c in conversations for m in c if m["role"] == "assistant")


def score_conversations(model, tokenizer, conversations, batch_size: int = 8, context=nullcontext) -> TextScore:
    """Loss on the answer tokens only (each assistant turn and its closing EOS) of chats under `model` and its own
    chat tokenizer, fitted to its context (fit_window), and bits per byte of the answer text scored; `documents`
    counts the chats."""
    conversations = list(conversations)
    if not conversations:
        raise ValueError("no chats: there is nothing to score")
    device = next(model.parameters()).device
    x, y, n_bytes = chat_rows(tokenizer, conversations, model.cfg.seq_len + 1)
    x, y = x.to(device), y.to(device)
    batches = ((x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, len(x), batch_size))
    loss, predicted = mean_loss(model, batches, context)
    return TextScore(loss=loss, bits_per_byte=bits_per_byte(loss, predicted, n_bytes), perplexity=math.exp(loss),
                     tokens=predicted, bytes=n_bytes, documents=len(conversations))


def answer_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each row's summed log-probability of its targets that are not IGNORE: logits (N, T, vocab), targets (N, T)
    → (N,), in fp32. A pair's answer under a model is this over its answer tokens (and their closing EOS)."""
    kept = targets != IGNORE
    picked = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * kept).sum(-1)


def pair_chats(pairs) -> tuple[list[list[dict]], list[list[dict]]]:
    """(chosen chats, rejected chats) of preference pairs {prompt: [messages before the answer], chosen: text,
    rejected: text}."""
    def answered(pair, key):
        return [*pair["prompt"], {"role": "assistant", "content": pair[key]}]

    return [answered(p, "chosen") for p in pairs], [answered(p, "rejected") for p in pairs]


@torch.no_grad()
def pair_logprobs(model, tokenizer, pairs, batch_size: int = 8, context=nullcontext) -> tuple[torch.Tensor, torch.Tensor]:
    """(log π(chosen | prompt), log π(rejected | prompt)) of each pair, summed over the answer tokens, each chat
    fitted to the model's context (fit_window), in eval mode; on the CPU, shape (pairs,)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    sums = []
    for chats in pair_chats(pairs):
        x, y, _ = chat_rows(tokenizer, chats, model.cfg.seq_len + 1)
        parts = []
        for i in range(0, len(x), batch_size):
            with context():
                logits = model(x[i : i + batch_size].to(device))[0]
            parts.append(answer_logprobs(logits, y[i : i + batch_size].to(device)).cpu())
        sums.append(torch.cat(parts))
    model.train(was_training)
    return sums[0], sums[1]


@dataclass
class PreferenceScore:
    """How well a model's own likelihoods rank held-out preference pairs, with no reference model (so any two
    models compare, whatever their tokenizers: a text's probability does not depend on how it is cut)."""
    loss_bits: float  # mean −log2 σ(log π(chosen) − log π(rejected)): lower is better
    accuracy: float  # share of pairs with log π(chosen) > log π(rejected)
    margin: float  # mean log π(chosen) − log π(rejected), nats
    pairs: int

    def to_dict(self) -> dict:
        return asdict(self)


def score_preferences(model, tokenizer, pairs, batch_size: int = 8, context=nullcontext) -> PreferenceScore:
    pairs = list(pairs)
    if not pairs:
        raise ValueError("no preference pairs: there is nothing to score")
    chosen, rejected = pair_logprobs(model, tokenizer, pairs, batch_size, context)
    gap = (chosen - rejected).double()
    loss_bits = float(-torch.nn.functional.logsigmoid(gap).mean() / math.log(2))
    return PreferenceScore(loss_bits, float((gap > 0).double().mean()), float(gap.mean()), len(pairs))
