"""Autoregressive sampling with a KV cache: the prompt is read once, then each step feeds only the newest token."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ultrathink.device import DeviceLike, place
from ultrathink.model.model import KVCache, UltraThink
from ultrathink.scoring import document_prefix


def sample_next(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None,
                generator: torch.Generator | None) -> torch.Tensor:
    """One token id per row of `logits` (B, V). temperature 0 means greedy."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the tokens ranked above it already hold top_p of the mass (the best one always stays).
        drop = cumulative - sorted_logits.softmax(-1) >= top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)


def crop_prompt(idx: torch.Tensor, context: int, max_new_tokens: int) -> torch.Tensor:
    """A prompt too long for the context keeps its last tokens, leaving room for max_new_tokens (at most half the
    context): the model reads the text nearest to what it continues."""
    keep = context - min(max_new_tokens, context // 2)
    return idx[:, -keep:] if idx.shape[1] > keep else idx


@torch.no_grad()
def stream(model: UltraThink, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
           top_k: int | None = None, top_p: float | None = None, eos_id: int | None = None,
           seed: int | None = None, use_cache: bool = True, device: DeviceLike | None = None) -> Iterator[torch.Tensor]:
    """Extend `idx` (B, T) token by token, yielding each step's new ids (B, 1), for up to max_new_tokens steps;
    rows that emitted eos_id keep emitting it, and the stream ends when all have. A prompt longer than the context
    allows is cropped to its last tokens (crop_prompt). Runs on `device` (the model is moved there) or, when None,
    on the model's device; `idx` is put there and the yielded ids are on it. The sampling generator lives on that
    device too, so a seed gives the same tokens as ever on a CPU."""
    model.eval()
    idx = idx.to(place(model, device))
    generator = torch.Generator(device=idx.device).manual_seed(seed) if seed is not None else None
    idx = crop_prompt(idx, model.cfg.seq_len, max_new_tokens)
    max_new_tokens = min(max_new_tokens, model.cfg.seq_len - idx.shape[1])
    cache = KVCache(model.cfg.n_layers) if use_cache else None
    finished = torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)
    fresh = idx
    for _ in range(max_new_tokens):
        logits = model(fresh if use_cache else idx, cache=cache).logits
        nxt = sample_next(logits[:, -1, :], temperature, top_k, top_p, generator)
        if eos_id is not None:
            nxt = nxt.masked_fill(finished[:, None], eos_id)
            finished |= nxt[:, 0] == eos_id
        idx = torch.cat([idx, nxt], dim=1)
        fresh = nxt
        yield nxt
        if finished.all():
            break


def generate(model: UltraThink, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, eos_id: int | None = None,
             seed: int | None = None, use_cache: bool = True, device: DeviceLike | None = None) -> torch.Tensor:
    """`idx` (cropped to the context, see crop_prompt) followed by the tokens `stream` generates: (B, T'), on the
    device generation ran on (`device`, else the model's)."""
    idx = idx.to(place(model, device))
    prompt = crop_prompt(idx, model.cfg.seq_len, max_new_tokens)
    new = list(stream(model, idx, max_new_tokens, temperature, top_k, top_p, eos_id, seed, use_cache))
    return torch.cat([prompt, *new], dim=1)


def stream_text(model: UltraThink, tokenizer, prompt: str, max_new_tokens: int, temperature: float,
                top_k: int | None, seed: int, top_p: float | None = None,
                device: DeviceLike | None = None, document: bool = True) -> Iterator[str]:
    """The continuation of `prompt` as text, piece by piece as tokens come, stopping at end-of-text. A piece is
    held back while it ends inside a multi-byte character (byte-level tokens can split one). Runs on `device` (the
    model is moved there) or, when None, on the model's device."""
    prefix = document_prefix(tokenizer) if document else []  # a chat's template writes its own BOS
    ids = prefix + tokenizer.encode(prompt, add_special_tokens=False) or [tokenizer.eos_token_id]
    new: list[int] = []
    shown = ""
    prompt_ids = torch.tensor([ids], dtype=torch.long, device=place(model, device))
    for token in stream(model, prompt_ids, max_new_tokens, temperature, top_k, top_p, tokenizer.eos_token_id, seed):
        if token.item() == tokenizer.eos_token_id:
            break
        new.append(token.item())
        text = tokenizer.decode(new)
        if not text.endswith("\ufffd") and len(text) > len(shown):
            yield text[len(shown):]
            shown = text
    text = tokenizer.decode(new)
    if len(text) > len(shown):
        yield text[len(shown):]


def generate_text(model: UltraThink, tokenizer, prompt: str, max_new_tokens: int, temperature: float,
                  top_k: int | None, seed: int, top_p: float | None = None,
                  device: DeviceLike | None = None) -> str:
    """The continuation of `prompt` as text (without the prompt), stopping at end-of-text, on `device` (else the
    model's)."""
    return "".join(stream_text(model, tokenizer, prompt, max_new_tokens, temperature, top_k, seed, top_p, device))
