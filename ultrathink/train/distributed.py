"""The one place where the distributed backend is chosen. The trainer sees a `Distributed` object: it wraps the
model, says whether this process is the main one (the only one that logs and writes files),
gathers the final weights, and averages numbers across processes. Launched by torchrun or by a stage itself
(launch.py), the environment (RANK, WORLD_SIZE, ...) says how many processes there are; each reads its own slice of
every global batch.

- ddp:  DistributedDataParallel. Gradients are all-reduced after backward, so every rank holds the same model and
        optimizer state (checked before each checkpoint) and the main rank's state is everyone's.
- deepspeed: DeepSpeed ZeRO (deepspeed_engine.py), also for a single process (a process group of one).
- fsdp: FSDP2 (`fully_shard`, one unit per block). Parameters, gradients and optimizer state are sharded; each rank
        writes its own shards of a checkpoint and reads back its own slices (sharded.py), so a checkpoint does not
        depend on the number of ranks and no rank holds the whole state.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.nn as nn

from ultrathink.model.routing import StepStats, flatten, unflatten


@dataclass
class Distributed:
    rank: int = 0
    world_size: int = 1
    backend: str = "single"
    device: str = "cpu"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def kind(self) -> str:
        """'cuda' or 'cpu': the device type, as autocast and precision choices want it."""
        return self.device.split(":")[0]

    @property
    def sharded(self) -> bool:
        return self.backend == "fsdp"

    def wrap(self, model: nn.Module) -> nn.Module:
        """The module to train: the model itself, a DDP wrapper around it, or the model sharded in place."""
        if self.backend == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            # No buffer broadcast: routing state moves identically on every rank (update_routing, from all-reduced
            # statistics) and is checked at every checkpoint, where a broadcast would hide a divergence.
            return DistributedDataParallel(model, broadcast_buffers=False)
        if self.sharded:
            from torch.distributed.fsdp import fully_shard

            for block in model.blocks:  # one unit per block: only one block's full weights exist at a time
                fully_shard(block)
            return fully_shard(model)
        return model

    def model_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's weights on the main rank (collective under FSDP: gathered, once, for the final model;
        checkpoints are written from the shards, sharded.py)."""
        if not self.sharded:
            return model.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    # ---- small collectives ---------------------------------------------------------------------------------
    def sum(self, value: float) -> float:
        """The sum of a per-rank number over all ranks."""
        if self.world_size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor)
        return tensor.item()

    def share(self, value):
        """The main rank's value (anything JSON can carry) on every rank."""
        if self.world_size == 1:
            return value
        box = [json.dumps(value) if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return json.loads(box[0])

    def sum_stats(self, stats: StepStats) -> StepStats:
        """Routing statistics (routing.py) summed over all ranks: one all-reduce of one flat tensor."""
        if self.world_size == 1 or not stats:
            return stats
        flat, layout = flatten(stats)
        dist.all_reduce(flat)
        return unflatten(flat, layout)

    def check_replicas(self, model: nn.Module) -> None:
        """Raise if the ranks' full copies of the weights differ (DDP, ZeRO-1/2): a checkpoint from rank 0 must
        stand for every rank."""
        if self.world_size == 1:
            return
        fingerprint = torch.stack([p.detach().double().sum() for p in model.parameters()]).to(self.device)
        low, high = fingerprint.clone(), fingerprint.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        if not torch.equal(low, high):
            raise RuntimeError("data-parallel ranks hold different weights; refusing to checkpoint")

    def check_routing_state(self, model: nn.Module) -> None:
        """Raise unless every rank holds exactly the same buffers (routing state: MoE selection biases, DRE
        thresholds and step counts). Buffers are never sharded, so this holds on every backend."""
        if self.world_size == 1:
            return
        names = [name for name, _ in model.named_buffers() if name in model.state_dict()]
        buffers = dict(model.named_buffers())
        if not names:
            return
        values = torch.cat([buffers[n].detach().double().flatten() for n in names]).to(self.device)
        low, high = values.clone(), values.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        if not torch.equal(low, high):
            sizes = [buffers[n].numel() for n in names]
            differ = [n for n, a, b in zip(names, low.split(sizes), high.split(sizes)) if not torch.equal(a, b)]
            raise RuntimeError(f"ranks hold different routing state ({', '.join(differ)}); refusing to checkpoint")

    def gather_rng_states(self) -> list[dict]:
        """Every rank's random number generator states (CPU, and its own GPU's), indexed by rank; collective."""
        mine = {"cpu": torch.get_rng_state(),  # and this rank's own GPU's (ranks may see different GPU counts)
                "cuda": [torch.cuda.get_rng_state(self.device)] if self.kind == "cuda" else []}
        if self.world_size == 1:
            return [mine]
        flat = torch.cat([mine["cpu"], *mine["cuda"]]).to(self.device)
        gathered = [torch.empty_like(flat) for _ in range(self.world_size)]
        dist.all_gather(gathered, flat)
        sizes = [len(mine["cpu"]), *(len(s) for s in mine["cuda"])]
        states = []
        for tensor in gathered:
            cpu, *cuda = tensor.cpu().split(sizes)
            states.append({"cpu": cpu.clone(), "cuda": [c.clone() for c in cuda]})
        return states

    def restore_rng_states(self, states: list[dict], seed: int, step: int) -> bool:
        """This rank's generators as a checkpoint saved them. A checkpoint written by another number of ranks has
        no state for this one: seed afresh per rank from the step instead and return False (exact replay needs the
        same world size)."""
        if len(states) != self.world_size:
            torch.manual_seed(seed + 1_000_003 * step + self.rank)
            return False
        torch.set_rng_state(states[self.rank]["cpu"])
        if states[self.rank]["cuda"] and self.kind == "cuda":
            torch.cuda.set_rng_state(states[self.rank]["cuda"][0], self.device)
        return True

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def finish(self) -> None:
        """End a run whose every rank has finished (call after the last barrier). One process: close the process
        group and return. Several: close it and end this process at once with exit code 0 (leave_at_once)."""
        self.close()
        if self.world_size > 1:
            leave_at_once()


def leave_at_once() -> NoReturn:
    """End a worker of a multi-process run once every rank has finished and its outputs are written: our log
    handlers and the standard streams are flushed, then the process exits with code 0 without running the
    interpreter's teardown. That teardown (DeepSpeed's and the process groups' destructors, at interpreter exit)
    aborted a ZeRO-3 worker now and then ("terminate called without an active exception", about 1 run in 4 on 2
    gloo ranks on CPU), failing a run whose outputs were complete; it happens in native destructors after our
    code has returned, so there is nothing of ours to fix there. The operating system releases the sockets and
    memory as well (tests/test_leave_at_once.py: leave_at_once keeps the output and the exit code even when a
    teardown hook would abort)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def as_float(norm: torch.Tensor) -> float:
    """A gradient norm as a number; under FSDP it is a DTensor whose full value needs one collective."""
    return (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item()


def setup(backend: str) -> Distributed:
    """Join the process group torchrun described in the environment; a single process needs no group."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    if cuda:
        # TF32 tensor cores for fp32 matmuls: ~8x the fp32 rate at 10-bit mantissa, accurate enough for training.
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    if world_size == 1 and backend != "deepspeed":
        return Distributed(device="cuda" if cuda else "cpu")
    backend = "ddp" if backend == "auto" else backend
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed's CPU accelerator: gloo, no CUDA probing
    # The timeout covers the main rank's solo work while the others wait in a collective: the plan's probe, the
    # final save and MLflow logging. device_id binds NCCL to this rank's GPU (no guess at the first barrier).
    group = dict(backend="nccl" if cuda else "gloo", timeout=datetime.timedelta(minutes=30),
                 **({"device_id": torch.device(device)} if cuda else {}))
    if world_size == 1:  # DeepSpeed in one process still talks through a process group: one of one, no network
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")  # what DeepSpeed reads where torchrun sets it
        dist.init_process_group(**group, store=dist.HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group(**group)
    return Distributed(dist.get_rank(), world_size, backend, device)
