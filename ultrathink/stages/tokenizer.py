"""tokenizer: train a byte-level BPE on the training split of the validated corpus (the validation text, chosen
exactly as prepare's split chooses it, stays unseen; under vocab_size auto, as many tokens as the corpus,
train.budget and the precision the run trains in call for), or take tokenizer.pretrained's as it is; save a
directory transformers can load."""

from pathlib import Path

from ultrathink.config import Params
from ultrathink.data.packing import training_texts
from ultrathink.device import resolve_device
from ultrathink.errors import StageError
from ultrathink.scoring import document_prefix
from ultrathink.tokenizer import copy_pretrained, precision_matters, run_length, train_tokenizer
from ultrathink.train.precision import resolve_precision


def run(params: Params) -> None:
    if params.tokenizer.pretrained:
        try:
            tokenizer = copy_pretrained(params.tokenizer.pretrained, Path(params.paths.tokenizer_dir))
        except (OSError, ValueError) as exc:
            raise StageError(str(exc)) from None
        before = tokenizer.convert_ids_to_tokens(document_prefix(tokenizer)) or "nothing"
        print(f"tokenizer: {params.tokenizer.pretrained} taken as it is (vocab {len(tokenizer):,}; documents "
              f"framed as {before} + text + {tokenizer.eos_token}) saved to {params.paths.tokenizer_dir}")
        return
    texts = training_texts(Path(params.paths.validated_corpus), params.prepare)
    budget, precision = params.train.budget, training_precision(params)
    vocab_size = train_tokenizer(texts, params.tokenizer, Path(params.paths.tokenizer_dir), budget, precision)
    why = f"train.budget {budget}" + (f", training in {precision}" if precision else "")
    chosen = (f" (tokenizer.vocab_size auto: from the corpus size, for a {run_length(budget, precision)}: {why})"
              if params.tokenizer.vocab_size == "auto" else "")
    print(f"tokenizer: vocab {vocab_size}{chosen} saved to {params.paths.tokenizer_dir}")


def training_precision(params: Params) -> str | None:
    """The precision the train stage will train in, where the auto vocabulary depends on it, else None."""
    if params.tokenizer.vocab_size != "auto":
        return None
    return precision_for_vocabulary(params.train.budget, params.train.precision)


def precision_for_vocabulary(budget: str | None, requested: str) -> str | None:
    """The precision a run of train.budget `budget` trains in on this machine where its auto vocabulary depends on
    it (a long time budget: precision_matters), else None: train.precision `requested` resolved as the train
    stage's plan resolves it, so `auto` measures (about a second on a CPU, paid only here)."""
    return resolve_precision(requested, resolve_device().type) if precision_matters(budget) else None
