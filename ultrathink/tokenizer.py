"""A byte-level BPE tokenizer trained on the corpus (or an open model's tokenizer, taken as it is: copy_pretrained),
saved so that `transformers.AutoTokenizer` loads it.

Byte-level with the full 256-byte initial alphabet means every string is encodable and decodes back unchanged: there
is no unknown token. The literal text "<|endoftext|>" inside a document is encoded as ordinary text
(`split_special_tokens`), so only the packer's own EOS ids mark document boundaries.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ultrathink.config import Budget, TokenizerConfig
from ultrathink.hashing import json_hash
from ultrathink.io import atomic_dir

# transformers takes about a second to import: it is imported where a tokenizer is built or loaded, so that the
# train stage and each of its ranks, which only hash the tokenizer's files (tokenizer_hash), never pay for it.
if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
MODEL_MAX_LENGTH = 2**62  # no length limit here: the model's seq_len decides, and long documents must not warn


# tokenizer.vocab_size auto: a share of √(corpus bytes), a multiple of 64 within the bounds. A vocabulary grows with
# the corpus, and with the run: a larger one spells more text a token (each step reads more of the corpus, each
# window holds more of it) but has more embeddings to learn, which pays only where the run trains tokens enough.
# Measured on three corpora (benchmarks/README.md, "The vocabulary follows the budget"): √bytes against ½·√bytes
# lost 0.22 bits/byte at 12 s on one fp32 core, tied at 30 s there, and at 2 minutes won on two corpora and tied on
# the third on the bf16 class, and won on the one corpus measured on one fp32 core. So a budget of at least LONG_RUN
# (seconds, or tokens) takes the larger share; a shorter one, a FLOPs budget (its tokens follow the shape the plan
# picks) and a run without a budget take the smaller. 1 MB of text: 512 or 1024; 1 GB: 16k or 32k.
# A long time budget trained in fp32 (a CPU without native bf16, the slow class) takes 1.5·√bytes: 2-minute runs
# there were better with it on all three corpora (12 of 12 pairs on one fp32 core, 0.005-0.049 bits/byte; on an
# AVX2-only EPYC Zen 3, at one shape and batch, 0.012-0.023 on each), where on the bf16 class it was worse or level
# (benchmarks/README.md, "A larger vocabulary pays on the slow class" and after). Only a time budget: a budget of
# tokens trains as many either way.
VOCAB_PER_ROOT_BYTE = {"short run": 0.5, "long run": 1.0, "long run in fp32": 1.5}
LONG_RUN = {"seconds": 60.0, "tokens": 1.5e6}
AUTO_VOCAB_BOUNDS = (320, 32768)


def run_length(budget: str | None, precision: str | None = None) -> str:
    """'long run' for a train.budget of at least LONG_RUN of its kind, else 'short run'; a long time budget that
    trains in fp32 (`precision`, as the train stage resolves train.precision on this machine) is a 'long run in
    fp32'."""
    parsed = Budget.parse(budget) if budget else None
    if parsed is None or parsed.kind not in LONG_RUN or parsed.amount < LONG_RUN[parsed.kind]:
        return "short run"
    return "long run in fp32" if parsed.kind == "seconds" and precision == "fp32" else "long run"


def precision_matters(budget: str | None) -> bool:
    """Whether the auto vocabulary of `budget` depends on the precision the run trains in (run_length)."""
    return run_length(budget, "fp32") != run_length(budget)


def auto_vocab_size(n_bytes: int, budget: str | None = None, precision: str | None = None) -> int:
    low, high = AUTO_VOCAB_BOUNDS
    share = VOCAB_PER_ROOT_BYTE[run_length(budget, precision)]
    return int(min(high, max(low, 64 * round(share * math.sqrt(n_bytes) / 64))))


def train_tokenizer(texts: Iterable[str], cfg: TokenizerConfig, out_dir: Path, budget: str | None = None,
                    precision: str | None = None) -> int:
    """Learn `cfg.vocab_size` byte-level BPE tokens (EOS and PAD included) from `texts`, or under `auto` a number
    that follows the texts' size, the run's `budget` (train.budget) and the `precision` it trains in
    (auto_vocab_size); replace `out_dir`. Returns the vocabulary size asked for."""
    if cfg.vocab_size == "auto":
        texts = list(texts)
        vocab_size = auto_vocab_size(sum(len(t.encode("utf-8")) for t in texts), budget, precision)
    else:
        vocab_size = cfg.vocab_size
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=cfg.min_frequency,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    from transformers import PreTrainedTokenizerFast

    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
        model_max_length=MODEL_MAX_LENGTH, split_special_tokens=True,
    )
    with atomic_dir(out_dir) as tmp:
        wrapped.save_pretrained(tmp)
    return vocab_size


def copy_pretrained(source: str | Path, out_dir: Path) -> PreTrainedTokenizerFast:
    """tokenizer.pretrained: take a Hugging Face tokenizer as it is (vocabulary, special tokens, the BOS it adds,
    chat template) and save it to `out_dir` (replaced). It needs an EOS token (documents are separated by it)."""
    source = Path(source)
    if not (source / "tokenizer.json").is_file():
        raise FileNotFoundError(f"tokenizer.pretrained: {source} holds no tokenizer.json (a fast tokenizer: "
                                "AutoTokenizer.from_pretrained(...).save_pretrained(dir) writes one)")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer.pretrained: {source} has no eos_token (tokenizer_config.json), which separates "
                         "documents in the packed token files")
    with atomic_dir(out_dir) as tmp:
        tokenizer.save_pretrained(tmp)
    return tokenizer


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """The tokenizer saved by `train_tokenizer`, from local files only."""
    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer at {path} (expected {path / 'tokenizer.json'}); train it first")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)



def tokenizer_hash(tokenizer_dir: str | Path) -> str:
    """Identity of a tokenizer: its vocabulary, merges and special tokens (not the file's formatting)."""
    spec = _spec(tokenizer_dir)
    identity = {"model": spec.get("model"),
                "added_tokens": [(t["id"], t["content"]) for t in spec.get("added_tokens", [])]}
    return json_hash(identity)


def vocab_difference(a_dir: str | Path, b_dir: str | Path, show: int = 3) -> str:
    """How two tokenizers' vocabularies differ, for an error message: sizes and the first ids that differ."""
    a, b = (_vocab(d) for d in (a_dir, b_dir))
    differing = [i for i in range(max(len(a), len(b))) if a.get(i) != b.get(i)]
    if not differing:
        return f"same {len(a)} tokens, other merges"
    shown = ", ".join(f"id {i}: {a.get(i)!r} vs {b.get(i)!r}" for i in differing[:show])
    return f"{len(a)} vs {len(b)} tokens, {len(differing)} ids differ ({shown})"


def _spec(tokenizer_dir: str | Path) -> dict:
    return json.loads((Path(tokenizer_dir) / "tokenizer.json").read_text(encoding="utf-8"))


def _vocab(tokenizer_dir: str | Path) -> dict[int, str]:
    spec = _spec(tokenizer_dir)
    vocab = {i: token for token, i in (spec.get("model", {}).get("vocab") or {}).items()}
    vocab.update({t["id"]: t["content"] for t in spec.get("added_tokens", [])})
    return vocab
