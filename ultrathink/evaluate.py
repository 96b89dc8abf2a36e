"""Held-out metrics: loss, perplexity, bits per byte, the unigram baseline they must beat, and sample generations."""

from __future__ import annotations

import math

import numpy as np

from ultrathink.config import EvaluateConfig
from ultrathink.model import UltraThink
from ultrathink.model.generate import generate_text
from ultrathink.train.loader import eval_batches
from ultrathink.train.trainer import mean_loss


def bits_per_byte(loss_nats: float, n_tokens: int, n_bytes: int) -> float:
    """Tokenizer-independent: the code length of the text in bits, divided by its UTF-8 size."""
    return loss_nats * n_tokens / (math.log(2) * n_bytes)


def unigram_cross_entropy(train_tokens: np.ndarray, val_tokens: np.ndarray, vocab_size: int) -> float:
    """Loss (nats/token) on val of a model that knows only train's token frequencies (add-one smoothed): the
    floor any model that uses context has to beat."""
    counts = np.bincount(train_tokens, minlength=vocab_size).astype(np.float64) + 1.0
    log_probs = np.log(counts / counts.sum())
    return float(-log_probs[val_tokens].mean())


def evaluate_split(model: UltraThink, val_tokens: np.ndarray, split_meta: dict, cfg: EvaluateConfig,
                   precision: str = "fp32") -> dict[str, float]:
    batches = eval_batches(val_tokens, model.cfg.seq_len, cfg.batch_size, cfg.max_batches)
    loss, predicted = mean_loss(model, batches, precision)
    return {
        "val_loss": loss,
        "val_perplexity": math.exp(loss),
        "val_bpb": bits_per_byte(loss, split_meta["tokens"], split_meta["bytes"]),
        "val_tokens_scored": float(predicted),
    }


def sample_generations(model: UltraThink, tokenizer, cfg: EvaluateConfig) -> list[dict[str, str]]:
    """For each prompt, the greedy continuation and one sampled with the configured temperature and top-k."""
    def complete(prompt: str, temperature: float) -> str:
        return generate_text(model, tokenizer, prompt, cfg.max_new_tokens, temperature, cfg.top_k, cfg.seed)

    return [{"prompt": p, "greedy": complete(p, 0.0), "sampled": complete(p, cfg.temperature)} for p in cfg.prompts]
