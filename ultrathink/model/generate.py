"""Autoregressive sampling with a KV cache: the prompt is read once, then each step feeds only the newest token."""

from __future__ import annotations

import torch

from ultrathink.model.model import KVCache, UltraThink


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


@torch.no_grad()
def generate(model: UltraThink, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, eos_id: int | None = None,
             seed: int | None = None, use_cache: bool = True) -> torch.Tensor:
    """Extend `idx` (B, T) by up to max_new_tokens; rows stop growing after they emit eos_id (padded with eos_id).
    The total length is capped by the model's context length."""
    model.eval()
    generator = torch.Generator(device=idx.device).manual_seed(seed) if seed is not None else None
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
        if finished.all():
            break
    return idx


def generate_text(model: UltraThink, tokenizer, prompt: str, max_new_tokens: int, temperature: float,
                  top_k: int | None, seed: int, top_p: float | None = None) -> str:
    """The continuation of `prompt` as text (without the prompt), stopping at end-of-text."""
    ids = tokenizer.encode(prompt, add_special_tokens=False) or [tokenizer.eos_token_id]
    prompt_ids = torch.tensor([ids], dtype=torch.long)
    out = generate(model, prompt_ids, max_new_tokens, temperature, top_k, top_p, tokenizer.eos_token_id, seed)
    new = [t for t in out[0, prompt_ids.shape[1]:].tolist() if t != tokenizer.eos_token_id]
    return tokenizer.decode(new)
