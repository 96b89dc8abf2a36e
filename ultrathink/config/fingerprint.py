"""Which knobs name a checkpoint's configuration, and the hashes of params that lineage records. Bookkeeping knobs
change when and how often things are recorded, not the numbers trained: a checkpoint made under other values of
these is still a valid point to resume from."""

from __future__ import annotations

from ultrathink.config.schema import AlignConfig, FinetuneConfig, ModelConfig, Params, TrainConfig
from ultrathink.hashing import json_hash

TRAIN_BOOKKEEPING = frozenset(
    {"eval_every", "eval_batches", "checkpoint_every", "keep_checkpoints", "keep_configs", "log_every", "resume",
         "threads", "max_bad_steps", "select", "calibrate", "init_from", "tensorboard"})
# finetune's and align's: `init_from` enters as the base's weights hash.
POST_TRAINING_BOOKKEEPING = frozenset({"enabled", "init_from", "eval_every", "samples"})


def weights_knobs(train: TrainConfig) -> dict:
    """train's knobs that determine the weights (`init_from` enters a fingerprint as the parent's weights hash, not
    as the text that named it). How the ranks share the work does not, nor does their number (launch.*, which is
    not in train): among the torch backends (one process, DDP, FSDP) a checkpoint resumes on any other, so only
    the engine family counts, and DeepSpeed keeps checkpoints of its own."""
    knobs = train.model_dump(exclude=set(TRAIN_BOOKKEEPING) | {"backend"})
    return {**knobs, "engine": "deepspeed" if train.backend == "deepspeed" else "torch"}


def training_params_hash(model: ModelConfig, train: TrainConfig) -> str:
    """The params part of a pretraining checkpoint's fingerprint: the model's and train's weight-determining knobs."""
    return json_hash({"model": model.model_dump(), "train": weights_knobs(train)})


def post_training_params_hash(name: str, section: FinetuneConfig | AlignConfig, train: TrainConfig) -> str:
    """The params part of a fine-tuning (`name` finetune) or alignment (align) checkpoint's fingerprint (`train`
    as that stage derives it)."""
    knobs = section.model_dump(exclude=set(POST_TRAINING_BOOKKEEPING))
    return json_hash({name: knobs, "train": weights_knobs(train)})


def section_hash(params: Params, *sections: str) -> str:
    """A stable hash of the named sections (by their params.yaml names), for lineage tags."""
    dump = params.model_dump(by_alias=True)
    return json_hash({s: dump[s] for s in sections})


def params_hash(params: Params) -> str:
    """Hash of every experiment knob (paths excluded: where files go does not change the model)."""
    return section_hash(params, *(f.alias or n for n, f in type(params).model_fields.items() if n != "paths"))
