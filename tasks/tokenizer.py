"""tokenizer: train a byte-level BPE on the validated corpus; save a directory transformers can load."""

import json
from pathlib import Path

from ultrathink.cli import stage_entry
from ultrathink.config import Params
from ultrathink.tokenizer import train_tokenizer


def read_texts(corpus_jsonl: str):
    with open(corpus_jsonl, encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["text"]


def run(params: Params) -> None:
    train_tokenizer(read_texts(params.paths.validated_corpus), params.tokenizer, Path(params.paths.tokenizer_dir))
    print(f"tokenizer: vocab {params.tokenizer.vocab_size} saved to {params.paths.tokenizer_dir}")


if __name__ == "__main__":
    stage_entry("tokenizer")
