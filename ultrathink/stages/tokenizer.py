"""tokenizer: train a byte-level BPE on the training split of the validated corpus (the validation text, chosen
exactly as prepare's split chooses it, stays unseen); save a directory transformers can load."""

from pathlib import Path

from ultrathink.config import Params
from ultrathink.data.packing import training_texts
from ultrathink.tokenizer import train_tokenizer


def run(params: Params) -> None:
    texts = training_texts(Path(params.paths.validated_corpus), params.prepare)
    vocab_size = train_tokenizer(texts, params.tokenizer, Path(params.paths.tokenizer_dir))
    chosen = " (tokenizer.vocab_size auto, from the corpus size)" if params.tokenizer.vocab_size == "auto" else ""
    print(f"tokenizer: vocab {vocab_size}{chosen} saved to {params.paths.tokenizer_dir}")

