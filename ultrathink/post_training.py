"""What the post-training stages (finetune, align) share around their training: recording that they are off, and
running on this process or on the ranks launch.* asks for."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ultrathink.config import Params
from ultrathink.errors import StageError
from ultrathink.io import atomic_dir, atomic_write_json
from ultrathink.launch import is_rank, run_ranks, starts_ranks


def record_off(stage: str, out_dir: str, status_file: str, report: str, plan: str) -> None:
    """Off, a stage writes a status file that says so (and an empty plan book, an output of the stage, if there is
    none), so the pipeline's DAG stays one whether it is on or off."""
    with atomic_dir(out_dir) as out:
        atomic_write_json(out / status_file, {"enabled": False})
    atomic_write_json(report, {"enabled": False})
    if not Path(plan).exists():
        atomic_write_json(plan, {})
    print(f"{stage}: off ({stage}.enabled: false)")


def refuse_deepspeed(stage: str, what: str, params: Params) -> None:
    if params.train.backend == "deepspeed":
        raise StageError(f"{stage} on several ranks runs under DDP or FSDP (train.backend auto, ddp or fsdp), and "
                         f"train.backend is deepspeed: set it for the {what} (--set train.backend=ddp)")


def run_post_training(stage: str, what: str, params: Params, train_on: Callable) -> None:
    """`train_on(dist, params)` on one process (the GPU when there is one, with the torch engine whatever
    train.backend says), or, when launch.* asks for several processes, on the ranks this starts, each running the
    stage: every rank trains; the main rank alone scores, samples, talks to MLflow and writes files. `what` names
    the work in the refusal of DeepSpeed ("fine-tune", "alignment")."""
    if starts_ranks(params.launch):
        refuse_deepspeed(stage, what, params)
        run_ranks(stage, params)
        return
    from ultrathink.train.distributed import setup

    if is_rank():
        refuse_deepspeed(stage, what, params)
    dist = setup(params.train.backend if is_rank() else "single")
    try:
        train_on(dist, params)
        dist.barrier()  # every rank is done, the main rank's files and MLflow run included
    except BaseException:
        dist.close()
        raise
    dist.finish()
