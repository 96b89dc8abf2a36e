"""train.backend: deepspeed — DeepSpeed ZeRO stages 1-3 behind the trainer's step.

The DeepSpeed JSON config is generated from params (`ds_config`): micro batch, accumulation, clipping, precision,
ZeRO stage and offload. The optimizer is ours (AdamW or Lion, with our weight-decay groups), handed to DeepSpeed,
which shards its state; so DeepSpeed never builds its fused Adam, and our learning-rate schedule keeps setting the
lr of that optimizer's param groups, which ZeRO steps with.

Precision: bf16 is DeepSpeed's `torch_autocast` (fp32 weights, bf16 matmuls: the numerics of the other backends);
fp16 is DeepSpeed's own fp16 mode with dynamic loss scaling (GPU only).

Checkpoints go through DeepSpeed's save_checkpoint/load_checkpoint (every rank writes its shard of the optimizer
state into the checkpoint's `deepspeed/` folder), inside our atomic, checksummed checkpoint directory. DeepSpeed's
stock loader unpickles anything (`weights_only=False`); ours loads with `weights_only=True`, allowing only the few
small state classes DeepSpeed itself writes (ZeRO stage, fragment addresses, loss scalers).
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import torch

from ultrathink.config import TrainConfig
from ultrathink.errors import StageError
from ultrathink.train.distributed import Distributed
from ultrathink.train.loader import BatchLayout
from ultrathink.train.optim import build_optimizers
from ultrathink.train.precision import resolve_precision

SHARDS_DIR = "deepspeed"  # DeepSpeed's own checkpoint files, inside ours
TAG = "ds"  # DeepSpeed's tag folder inside SHARDS_DIR
NEVER = 2**31 - 1  # DeepSpeed's own progress printing: off (the trainer prints the step line)


def ds_config(cfg: TrainConfig, precision: str, world_size: int) -> dict:
    """The DeepSpeed config for these train.* params."""
    ds, layout = cfg.deepspeed, BatchLayout.split(cfg.batch_size, cfg.grad_accum, world_size)
    zero: dict = {"stage": ds.zero_stage}
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    if ds.offload_params:
        zero["offload_param"] = {"device": "cpu"}
    config = {
        "train_micro_batch_size_per_gpu": layout.micro,
        "gradient_accumulation_steps": layout.accum,
        "train_batch_size": layout.sequences,
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,  # our torch optimizer, not one DeepSpeed compiles
        "zero_force_ds_cpu_optimizer": False,  # offload steps our optimizer on the CPU copy as well
        "steps_per_print": NEVER,
        "wall_clock_breakdown": False,
    }
    if precision == "bf16":
        # No module's gradients reduced in bf16 (DeepSpeed's default tags every Linear): fp32, as DDP and FSDP.
        config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}
    elif precision == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": 0}  # 0: dynamic loss scaling
    return config


def safe_checkpoint_engine():
    """DeepSpeed's torch checkpoint engine with a loader that never unpickles arbitrary objects."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    allowed = [ZeroStageEnum, fragment_address, LossScaler, DynamicLossScaler]
    pickle_by_value(ZeroStageEnum)

    class SafeTorchCheckpointEngine(TorchCheckpointEngine):
        def load(self, path: str, map_location=None):
            with torch.serialization.safe_globals(allowed):
                return torch.load(path, map_location=map_location, weights_only=True)

    return SafeTorchCheckpointEngine()


def pickle_by_value(enum_class: type) -> None:
    """Pickle `enum_class`'s members as `enum_class(value)`, as Python 3.11.5 and later do for every Enum.

    Python 3.11.0-3.11.4 (Debian 12's python3 is 3.11.2) pickle them as `getattr(enum_class, name)`. A weights_only
    load refuses that call, and must: an allowed getattr would reach any attribute of anything. DeepSpeed's optimizer
    checkpoints hold a ZeroStageEnum, so a run saved there could not resume (every ZeRO stage, on 2 ranks)."""
    enum_class.__reduce_ex__ = lambda member, protocol: (type(member), (member.value,))


def skip_shared_memory_op() -> None:
    """Keep DeepSpeed from compiling its shared-memory all-reduce when it sets up its communication backend.

    On the CPU accelerator, that setup JIT-compiles a C++ op (`deepspeed_shm_comm`: 26 s on an idle 2-core EPYC,
    75 s beside other work, and a compiler required) for every new interpreter path or clean cache. Only DeepSpeed's
    inference all-reduce (tensor-parallel serving) calls that op; ZeRO's reductions go through torch.distributed.
    So the op is marked incompatible in DeepSpeed's table of probed ops, which it reads before building and lets
    edits persist in (`deepspeed.ops.__compatible_ops__`).
    """
    import deepspeed.ops
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False


class WorldSizeError(StageError):
    """A DeepSpeed checkpoint cannot resume on another number of ranks."""


class DeepSpeedEngine:
    def __init__(self, model: torch.nn.Module, cfg: TrainConfig, dist: Distributed):
        import deepspeed

        self.model, self.cfg, self.dist = model, cfg, dist
        self.stage = cfg.deepspeed.zero_stage
        self.precision = resolve_precision(cfg.precision, dist.kind)
        self.optimizers = build_optimizers(model, cfg)  # one: the schema refuses Muon with DeepSpeed
        if self.stage == 3:
            # The tied output layer reads the embedding matrix outside the embedding's own forward; ZeRO-3 must
            # gather it for the whole model's forward, not only the embedding's.
            deepspeed.zero.register_external_parameter(model, model.embed.weight)
        skip_shared_memory_op()
        self.module, _, _, _ = deepspeed.initialize(
            model=model, optimizer=self.optimizers[0], config=ds_config(cfg, self.precision, dist.world_size),
            dist_init_required=False)
        self.module.checkpoint_engine = safe_checkpoint_engine()

    def autocast(self):
        return contextlib.nullcontext()  # DeepSpeed applies the precision of its config inside its forward

    def backward(self, loss: torch.Tensor) -> None:
        # DeepSpeed divides by the accumulation steps itself and steps the optimizer only at the last micro-batch.
        self.module.backward(loss)
        self.module.step()

    def step(self, loss: float) -> tuple[float, bool]:
        """DeepSpeed already clipped and stepped (or skipped a non-finite gradient): report what it did."""
        norm = self.module.get_global_grad_norm()
        norm = math.nan if norm is None else float(norm)
        applied = self.module.was_step_applied()
        if self.precision == "fp16" and math.isfinite(loss):
            applied = True  # an fp16 overflow is routine: the loss scaler skipped it and lowered its scale
        return norm, applied

    def state_dict(self) -> dict:
        return {}  # optimizer state, loss scale and step counts live in DeepSpeed's own checkpoint files

    def save_shards(self, directory: Path) -> None:
        """Collective: every rank writes its part of the optimizer state."""
        self.module.save_checkpoint(str(directory / SHARDS_DIR), tag=TAG, save_latest=False)

    writes_weights = False  # the main rank holds (ZeRO-1/2) or gathers (ZeRO-3) the full weights

    def load(self, checkpoint, state: dict) -> None:
        written_by = checkpoint.manifest.get("world_size", self.dist.world_size)
        if written_by != self.dist.world_size:
            raise WorldSizeError(
                f"{checkpoint.path} was written by DeepSpeed on {written_by} ranks and this run has "
                f"{self.dist.world_size}: its ZeRO optimizer state is partitioned per rank and is not resharded "
                f"here. Resume on {written_by} ranks (launch.nproc_per_node × launch.nnodes), or start over with "
                "train.resume: false (the checkpoints are kept aside)")
        path, _ = self.module.load_checkpoint(str(checkpoint.path / SHARDS_DIR), tag=TAG, load_module_strict=True,
                                              load_optimizer_states=True, load_lr_scheduler_states=False)
        if path is None:
            raise RuntimeError(f"{checkpoint.path}: no DeepSpeed state in it (written by another backend?)")

    def model_state(self) -> dict[str, torch.Tensor]:
        """Full fp32 weights (collective under ZeRO-3: gathered on the main rank, empty elsewhere)."""
        if self.stage == 3:
            state = self.module._zero3_consolidated_16bit_state_dict() or {}
        else:
            state = self.model.state_dict()
        return {k: v.float() if v.is_floating_point() else v for k, v in state.items()}

    def load_weights_from(self, checkpoint) -> None:
        weights = checkpoint.load_weights()
        if self.stage != 3:
            self.model.load_state_dict(weights)
            return
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(self.model.parameters()), modifier_rank=0):
            if self.dist.is_main:
                self.model.load_state_dict(weights)

    def check_replicas(self) -> None:
        if self.stage < 3:  # ZeRO-1/2 shard optimizer state and gradients; every rank holds the whole model
            self.dist.check_replicas(self.model)
