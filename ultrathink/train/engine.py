"""How one training step is taken: forward precision, backward, clipping, the optimizer update, and the model and
optimizer state that checkpoints carry. The trainer drives an engine; `build_engine` is the one place that picks it.

- TorchEngine: a single process, DDP or FSDP2 (the wrapping is `Distributed.wrap`). autocast for bf16/fp16, a
  gradient scaler for fp16, clipping on the true (unscaled, all-reduced) norm, our optimizers stepped directly.
- DeepSpeedEngine (deepspeed_engine.py): ZeRO stages 1-3; DeepSpeed owns backward, accumulation, clipping,
  precision and the sharded optimizer state, and saves that state with its own checkpoint code.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from pathlib import Path
from typing import Protocol

import torch

from ultrathink.config import TrainConfig
from ultrathink.device import device_type
from ultrathink.train import sharded
from ultrathink.train.distributed import Distributed, as_float
from ultrathink.train.loader import BatchLayout
from ultrathink.train.optim import build_optimizers
from ultrathink.train.precision import resolve_precision


def autocast_dtype(precision: str, device: str = "cpu") -> torch.dtype | None:
    """The dtype autocast runs in for train.precision on this device; None for fp32 (no autocast)."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(resolve_precision(precision, device_type(device)))


def autocast(precision: str, device: str = "cpu"):
    dtype = autocast_dtype(precision, device)
    return torch.autocast(device_type=device_type(device), dtype=dtype) if dtype else contextlib.nullcontext()


class Engine(Protocol):
    model: torch.nn.Module  # the model (its parameters sharded in place under FSDP): what is evaluated and saved
    module: torch.nn.Module  # what the forward pass runs through (the model, or a wrapper of it)
    flops_per_token: int  # the whole model's training FLOPs per token, counted before any sharding
    optimizers: list[torch.optim.Optimizer]  # the learning-rate schedule sets their param groups' lr
    writes_weights: bool  # save_shards writes the checkpoint's model.safetensors (no full gather for it)

    def autocast(self): ...
    def backward(self, loss: torch.Tensor) -> None: ...
    def step(self, loss: float) -> tuple[float, bool]: ...
    def state_dict(self) -> dict: ...
    def load(self, checkpoint, state: dict) -> None: ...
    def model_state(self) -> dict[str, torch.Tensor]: ...
    def load_weights_from(self, checkpoint) -> None: ...
    def save_shards(self, directory: Path) -> None: ...
    def check_replicas(self) -> None: ...


def clip_grad_norm(parameters: list[torch.nn.Parameter], max_norm: float) -> float:
    """torch's `clip_grad_norm_`, the norm before clipping returned as a number, without its multiply where that
    multiply is by exactly 1: the gradients come out bitwise as torch leaves them. torch multiplies every gradient
    by max_norm / (norm + 1e-6) in fp32, clamped at 1, on every step. Most steps of a run are within max_norm (at
    the issue's shape d384 × 6 the norm fell below 1.0 at step 11), and on a CPU that multiply, a read and a write
    of every gradient, took 1.3 ms of a 280 ms step there (benchmarks/README.md). The margin of 1e-6 covers fp32's
    rounding of that quotient; train.grad_clip 0 (no limit) never multiplies."""
    total = torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None])
    norm = as_float(total)
    if not (norm + 1e-6) * (1 + 1e-6) <= max_norm:  # also a non-finite norm, as torch does
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
    return norm


# torch.compile's Inductor options by device type. On a CPU, its C++ wrapper calls the compiled kernels from C++,
# not from generated Python: the compiled step at d384 × 6 ran 4.0% and 4.9% faster side by side (built first and
# built second), for a cold compile 10-20 s longer (benchmarks/README.md; COMPILE_PAYS_AFTER_SECONDS covers it).
# Not measured on a GPU, so Inductor's default there.
COMPILE_OPTIONS = {"cpu": {"cpp_wrapper": True}}


def cannot_compile(device: str) -> str | None:
    """Why torch.compile cannot build a step on `device` here, or None. On a CPU Inductor writes the step as C++ and
    builds it with the compiler its config names ($CXX, else g++), found by Inductor's own search, against the
    Python headers (each kernel gets Python bindings): without either the first compiled step fails. A slim container
    image has no compiler; a system Python without its development package has no headers. GPUs are not checked
    (their Triton kernels need a C compiler for the launcher, not tried here)."""
    if device_type(device) != "cpu":
        return None
    from torch._inductor import config
    from torch._inductor.cpp_builder import _get_python_related_args, get_cpp_compiler
    from torch._inductor.exc import InvalidCxxCompiler

    try:
        get_cpp_compiler()
    except InvalidCxxCompiler:  # cpp.cxx is one name or a list to search, as get_cpp_compiler reads it
        names = config.cpp.cxx if isinstance(config.cpp.cxx, (list, tuple)) else (config.cpp.cxx,)
        return f"no working C++ compiler ({', '.join(c for c in names if c)} tried; set CXX to one)"
    with warnings.catch_warnings():  # Inductor warns of missing headers; the reason below says it
        warnings.simplefilter("ignore")
        include_dirs = _get_python_related_args()[0]
    if not any((Path(folder) / "Python.h").is_file() for folder in include_dirs):
        return (f"no Python headers (Python.h is in none of {', '.join(dict.fromkeys(include_dirs))}: install this "
                f"Python's development package)")
    return None


class TorchEngine:
    def __init__(self, model: torch.nn.Module, cfg: TrainConfig, dist: Distributed):
        self.model, self.cfg, self.dist = model, cfg, dist
        self.module = dist.wrap(model)  # before the optimizers: FSDP replaces parameters with sharded ones
        if cfg.compile is True:  # auto is decided before training (budget.py); a Trainer given auto runs eager
            self.module = torch.compile(self.module, options=COMPILE_OPTIONS.get(dist.kind))
        self.optimizers = build_optimizers(model, cfg)
        self.accum = BatchLayout.split(cfg.batch_size, cfg.grad_accum, dist.world_size).accum
        # fp16 needs loss scaling so small gradients do not underflow; bf16 and fp32 do not (scaler disabled).
        self.scaler = torch.amp.GradScaler(dist.kind, enabled=resolve_precision(cfg.precision, dist.kind) == "fp16")

    def autocast(self):
        return autocast(self.cfg.precision, self.dist.device)

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss / self.accum).backward()

    def step(self, loss: float) -> tuple[float, bool]:
        """Clip and apply the accumulated gradients: (norm before clipping, whether the update was applied). A
        non-finite loss or gradient skips the update. Under fp16 an overflowed gradient is routine: the scaler
        skips that update itself and lowers its scale, and it counts as taken."""
        for opt in self.optimizers:
            self.scaler.unscale_(opt)  # clip the true gradient norm, not the loss-scaled one
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else math.inf
        grad_norm = clip_grad_norm(list(self.model.parameters()), max_norm)
        applied = math.isfinite(loss) and (math.isfinite(grad_norm) or self.scaler.is_enabled())
        if applied:
            for opt in self.optimizers:
                self.scaler.step(opt)
        if applied or self.scaler.is_enabled():
            # Also after a skipped step: update() closes the unscale_ above (else the next step's unscale_ raises)
            # and, the gradients being non-finite, lowers the scale.
            self.scaler.update()
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        return grad_norm, applied

    def state_dict(self) -> dict:
        """What state.pt carries; the optimizers' tensors go to the shards (save_shards)."""
        return {"optimizer_groups": sharded.optimizer_groups(self.model, self.optimizers),
                "grad_scaler": self.scaler.state_dict()}

    def save_shards(self, directory: Path) -> None:
        """Every rank writes its shards of the optimizer state (sharded.py) and, under FSDP, of the weights,
        which become one model.safetensors without being gathered anywhere (collective)."""
        if self.dist.sharded:
            self._refuse_non_finite()
            sharded.save_weights_from_shards(self.model, directory, self.dist.is_main)
        sharded.save_optimizers(self.model, self.optimizers, directory, self._alone)

    @property
    def writes_weights(self) -> bool:
        """Whether save_shards writes model.safetensors itself (so nobody gathers the weights for it)."""
        return self.dist.sharded

    def _refuse_non_finite(self) -> None:
        local = [p.to_local() if hasattr(p, "to_local") else p for p in self.model.state_dict().values()]
        bad = torch.stack([~torch.isfinite(t).all() for t in local if t.is_floating_point()]).sum().double()
        bad = bad.to(self.dist.device).reshape(1)  # NCCL reduces device tensors only
        torch.distributed.all_reduce(bad)
        if bad.item():
            raise ValueError("refusing to checkpoint non-finite weights")

    def load(self, checkpoint, state: dict) -> None:
        self.load_weights_from(checkpoint)
        self.load_optimizer(checkpoint, state)

    def load_optimizer(self, checkpoint, state: dict) -> None:
        sharded.load_optimizers(self.model, self.optimizers, checkpoint.path, state["optimizer_groups"], self._alone)
        self.scaler.load_state_dict(state["grad_scaler"])

    def model_state(self) -> dict[str, torch.Tensor]:
        return self.dist.model_state(self.model)

    def load_weights_from(self, checkpoint) -> None:
        sharded.load_weights(self.model, checkpoint.path, self._alone)

    @property
    def _alone(self) -> bool:
        return self.dist.world_size == 1

    def check_replicas(self) -> None:
        if not self.dist.sharded:  # under FSDP each rank holds its own shard, not a replica
            self.dist.check_replicas(self.model)


def build_engine(model: torch.nn.Module, cfg: TrainConfig, dist: Distributed) -> Engine:
    """The engine that takes `model`'s training steps on `dist`'s backend: it wraps the model (DDP), shards it in
    place (FSDP) or hands it to DeepSpeed, and builds the optimizers. Collective under torchrun."""
    flops_per_token = model.flops_per_token()  # before ZeRO-3 leaves each rank a slice of every tensor
    if dist.backend == "deepspeed":
        from ultrathink.train.deepspeed_engine import DeepSpeedEngine  # DeepSpeed is imported only when used

        engine = DeepSpeedEngine(model, cfg, dist)
    else:
        engine = TorchEngine(model, cfg, dist)
    engine.flops_per_token = flops_per_token
    return engine
