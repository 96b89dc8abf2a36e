"""A stage that starts its own ranks: the train stage under `launch.nproc_per_node` × `launch.nnodes` > 1 runs
`python -m tasks.train` once per rank through PyTorch's elastic launcher (torch.distributed.launcher, the API behind
torchrun), with the params it was given, and waits for them. Whoever runs the stage (dvc repro, ultrathink run,
ultrathink stage, the Prefect deployment) needs no launcher of its own, and dvc.yaml no edit.

A rank that fails stops all of them; the stage then fails with that rank's own error (its exception, recorded by
the rank in torchelastic's error file), not with the broken-connection errors of the ranks it left waiting.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import uuid
from pathlib import Path

import yaml

from ultrathink.config import LaunchConfig, Params
from ultrathink.errors import StageError


class RankFailed(StageError):
    """A rank of a launched stage failed."""


def is_rank() -> bool:
    """Whether this process is a rank that a launcher (ours or torchrun) started."""
    return "LOCAL_RANK" in os.environ


def starts_ranks(launch: LaunchConfig) -> bool:
    """Whether a stage run here should start launch's ranks rather than train itself."""
    return launch.world_size > 1 and not is_rank()


def run_ranks(stage: str, params: Params) -> None:
    """Run `python -m tasks.<stage>` on every rank of this machine with `params`, and wait; RankFailed names the
    first rank that failed and its error."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    launch = params.launch
    with tempfile.TemporaryDirectory(prefix=f"ultrathink-{stage}-") as tmp:
        params_file = Path(tmp) / "params.yaml"  # exactly these params (with any --set) for every rank
        params_file.write_text(yaml.safe_dump(params.model_dump(by_alias=True, mode="json"), sort_keys=False))
        try:
            with _threads_per_rank(launch.nproc_per_node):
                elastic_launch(_launcher_config(launch), entrypoint=sys.executable)(
                    "-m", f"tasks.{stage}", "--params", str(params_file))
        except ChildFailedError as failed:
            raise RankFailed(_first_failure(failed)) from None


def _launcher_config(launch: LaunchConfig):
    from torch.distributed.launcher.api import LaunchConfig as ElasticConfig

    if launch.nnodes == 1 and not launch.rdzv_endpoint:  # one machine: a private rendezvous on a free port
        rendezvous = dict(rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", run_id=str(uuid.uuid4()))
    elif launch.node_rank is not None:  # the machines' ranks are given: a static rendezvous at the endpoint
        rendezvous = dict(rdzv_backend="static", rdzv_endpoint=launch.rdzv_endpoint,
                          rdzv_configs={"rank": launch.node_rank}, run_id="ultrathink")
    else:  # the c10d rendezvous assigns them (one machine hosts the store at the endpoint)
        rendezvous = dict(rdzv_backend="c10d", rdzv_endpoint=launch.rdzv_endpoint, run_id="ultrathink")
    return ElasticConfig(min_nodes=launch.nnodes, max_nodes=launch.nnodes, nproc_per_node=launch.nproc_per_node,
                         max_restarts=launch.max_restarts, monitor_interval=0.5, start_method="spawn", **rendezvous)


@contextlib.contextmanager
def _threads_per_rank(nproc: int):
    """Each rank's share of this machine's cores, as torchrun sets it (unless OMP_NUM_THREADS is set already), so
    the ranks do not oversubscribe the cores; train.threads still sets each rank's count where given."""
    if "OMP_NUM_THREADS" in os.environ:
        yield
        return
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    try:
        yield
    finally:
        del os.environ["OMP_NUM_THREADS"]


def _first_failure(failed) -> str:
    """'rank R (exit code C): <its exception>' of the rank that failed first among those that recorded an error
    (the others were stopped by the launcher or lost their peer)."""
    recorded = {rank: f for rank, f in failed.failures.items() if f.error_file_data.get("message")}
    rank, failure = min((recorded or failed.failures).items(), key=lambda item: item[1].timestamp)
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", json.dumps(message))
    return f"rank {rank} (exit code {failure.exitcode}): {message}"
