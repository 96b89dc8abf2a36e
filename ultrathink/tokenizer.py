"""A byte-level BPE tokenizer trained on the corpus, saved so that `transformers.AutoTokenizer` loads it.

Byte-level with the full 256-byte initial alphabet means every string is encodable and decodes back unchanged: there
is no unknown token. The literal text "<|endoftext|>" inside a document is encoded as ordinary text
(`split_special_tokens`), so only the packer's own EOS ids mark document boundaries.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from ultrathink.config import TokenizerConfig

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
MODEL_MAX_LENGTH = 2**62  # no length limit here: the model's seq_len decides, and long documents must not warn


def train_tokenizer(texts: Iterable[str], cfg: TokenizerConfig, out_dir: Path) -> None:
    """Learn `cfg.vocab_size` byte-level BPE tokens (EOS and PAD included) from `texts`; replace `out_dir`."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=cfg.min_frequency,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
        model_max_length=MODEL_MAX_LENGTH, split_special_tokens=True,
    )
    with staged_dir(Path(out_dir)) as tmp:
        wrapped.save_pretrained(tmp)


def load_tokenizer(path: Path) -> PreTrainedTokenizerFast:
    """The tokenizer saved by `train_tokenizer`, from local files only."""
    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer at {path} (expected {path / 'tokenizer.json'}); train it first")
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


@contextmanager
def staged_dir(final: Path) -> Iterator[Path]:
    """Yield an empty temp dir next to `final`; on success it replaces `final`, on error it is deleted.

    Readers therefore see the old complete output or the new complete output, never a half-written one.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        tmp.chmod(0o755)  # mkdtemp makes it owner-only
        if final.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
            os.replace(final, old / final.name)  # a rename cannot overwrite a non-empty dir: move it aside first
            os.replace(tmp, final)
            shutil.rmtree(old)
        else:
            os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
