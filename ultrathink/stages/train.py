"""train: pretrain the UltraThink decoder on the packed tokens; write the final weights (and keep resumable
checkpoints). One MLflow run per trained model carries its params, per-step curves and lineage.

What one process, or each launched rank, does is ultrathink/stages/pretrain.py. This module only decides whether to
start ranks first, so a process that launches them imports none of the training code (it starts in about a second,
not five)."""

from ultrathink.config import Params
from ultrathink.launch import run_ranks, starts_ranks


def run(params: Params) -> None:
    if starts_ranks(params.launch):  # launch.* asks for several processes: start them, each runs this stage
        run_ranks("train", params)
        return
    from ultrathink.stages.pretrain import pretrain  # here, not above: a launching process needs none of it

    pretrain(params)
