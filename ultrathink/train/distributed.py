"""The one place where the distributed backend is chosen. The trainer sees a `Distributed` object: it wraps the
model, says whether this process is the main one (the only one that logs and writes files), and averages numbers
across processes. Launched by torchrun, the environment (RANK, WORLD_SIZE, ...) says how many processes there are.

- ddp: DistributedDataParallel; gradients all-reduced after backward, so every rank holds the same model, the
  main rank's checkpoint is everyone's, and each rank reads its own slice of every global batch.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn


@dataclass
class Distributed:
    rank: int = 0
    world_size: int = 1
    backend: str = "single"
    device: str = "cpu"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def wrap(self, model: nn.Module) -> nn.Module:
        """The module to train: the model itself, or a data-parallel wrapper around it."""
        if self.backend == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            return DistributedDataParallel(model)
        return model

    def mean(self, value: float) -> float:
        """Average of a per-rank number (a loss) over all ranks."""
        if self.world_size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor)
        return tensor.item() / self.world_size

    def check_replicas(self, model: nn.Module) -> None:
        """Raise if the ranks' weights differ: a checkpoint from rank 0 must stand for every rank."""
        if self.world_size == 1:
            return
        fingerprint = torch.stack([p.detach().double().sum() for p in model.parameters()]).to(self.device)
        low, high = fingerprint.clone(), fingerprint.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        if not torch.equal(low, high):
            raise RuntimeError("data-parallel ranks hold different weights; refusing to checkpoint")

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def close(self) -> None:
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def setup(backend: str) -> Distributed:
    """Join the process group torchrun described in the environment; a single process needs no group."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return Distributed()
    backend = "ddp" if backend == "auto" else backend
    cuda = torch.cuda.is_available()
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(minutes=10))
    return Distributed(dist.get_rank(), world_size, backend, device)
