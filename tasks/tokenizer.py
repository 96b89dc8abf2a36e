"""tokenizer: train a byte-level BPE on the training documents of the validated corpus (the validation documents,
chosen by the same hash as prepare's split, stay unseen); save a directory transformers can load."""

import json
from pathlib import Path

from ultrathink.cli import stage_entry
from ultrathink.config import Params
from ultrathink.data.packing import split_fraction
from ultrathink.tokenizer import train_tokenizer


def training_texts(corpus_jsonl: str, val_fraction: float):
    with open(corpus_jsonl, encoding="utf-8") as f:
        for line in f:
            text = json.loads(line)["text"]
            if split_fraction(text) >= val_fraction:
                yield text


def run(params: Params) -> None:
    texts = training_texts(params.paths.validated_corpus, params.prepare.val_fraction)
    train_tokenizer(texts, params.tokenizer, Path(params.paths.tokenizer_dir))
    print(f"tokenizer: vocab {params.tokenizer.vocab_size} saved to {params.paths.tokenizer_dir}")


if __name__ == "__main__":
    stage_entry("tokenizer")
