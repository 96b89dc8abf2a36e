"""Tiny random Hugging Face checkpoints of each supported family, built locally with transformers (no downloads),
with non-trivial weights: norms ≠ 1 and biases ≠ 0, so a tensor the import forgets changes the logits."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (AutoModelForCausalLM, LlamaConfig, MistralConfig, PreTrainedTokenizerFast, Qwen2Config,
                          Qwen3Config)

SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=96, max_position_embeddings=128, rms_norm_eps=1e-6)

FAMILIES = {
    "llama": lambda vocab: LlamaConfig(**SHAPE, vocab_size=vocab, rope_theta=50000.0),
    "llama3_rope": lambda vocab: LlamaConfig(**SHAPE, vocab_size=vocab, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}, rope_theta=500000.0),
    "mistral": lambda vocab: MistralConfig(**{**SHAPE, "max_position_embeddings": 256}, vocab_size=vocab,
                                           sliding_window=128),
    "qwen2": lambda vocab: Qwen2Config(**SHAPE, vocab_size=vocab, rope_theta=1e6, tie_word_embeddings=False),
    "qwen3": lambda vocab: Qwen3Config(**SHAPE, vocab_size=vocab, head_dim=16, rope_theta=1e6,
                                       tie_word_embeddings=True),  # q/k norms (perturbed like every norm)
    "tied": lambda vocab: LlamaConfig(**SHAPE, vocab_size=vocab, tie_word_embeddings=True),  # SmolLM's layout
}

TEXTS = ["def f(x):\n    return x + 1", "The class statement defines a class.", "A list is a sequence of items.",
         "Python is a programming language that lets you work quickly."] * 30


SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>"]


def pair_bpe() -> Tokenizer:
    """A byte-level BPE whose vocabulary is every byte and every pair of bytes (65,794 tokens): ids past 65,535, as
    Llama 3's 128,256-token vocabulary has. The pairs of "the cat sat on the mat" come last: they get ids > 65,535."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    last = {("t", "h"), ("h", "e"), ("c", "a"), ("a", "t"), ("s", "a"), ("o", "n"), ("m", "a")}
    pairs = sorted(((a, b) for a in alphabet for b in alphabet), key=lambda p: p in last)
    vocab = {token: i for i, token in enumerate([*SPECIALS, *alphabet, *(a + b for a, b in pairs)])}
    return Tokenizer(models.BPE(vocab=vocab, merges=pairs))


def tokenizer(vocab_size: int = 384, bos: bool = True, chat_template: str | None = None,
              large: bool = False) -> PreTrainedTokenizerFast:
    """A byte-level BPE in the Llama 3 style: <|begin_of_text|> added before each text when `bos`, <|end_of_text|>
    as EOS; trained on TEXTS, or `large` (pair_bpe)."""
    bpe = pair_bpe() if large else Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    if not large:
        bpe.train_from_iterator(TEXTS, trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False))
    else:
        bpe.add_special_tokens(SPECIALS)
    if bos:
        bpe.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
            special_tokens=[("<|begin_of_text|>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|begin_of_text|>",
                                   eos_token="<|end_of_text|>", chat_template=chat_template)


def perturb(model: torch.nn.Module, seed: int = 0) -> None:
    """Norm weights away from 1 and biases away from 0 (transformers initialises them to exactly those)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=generator))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=generator))


def save_family(family: str, out: Path, vocab: int = 384, tok=None, dtype=torch.float32, seed: int = 0,
                max_shard_size: str | None = None) -> Path:
    """A random `family` checkpoint with a tokenizer in `out` (config.json, safetensors, tokenizer files)."""
    torch.manual_seed(seed)
    tok = tok or tokenizer(vocab)
    config = FAMILIES[family](max(vocab, len(tok)))
    config.bos_token_id, config.eos_token_id = tok.bos_token_id, tok.eos_token_id
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    perturb(model, seed)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kwargs)
    tok.save_pretrained(out)
    return out
