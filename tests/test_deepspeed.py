"""The DeepSpeed backend's config comes from params, its impossible combinations fail early, its checkpoint
loader never unpickles arbitrary objects, and it compiles no op that training does not call. (Training with it on 2
processes: test_distributed.py.)"""

from __future__ import annotations

import pickle

import pytest
import torch

from ultrathink.config import TrainConfig
from ultrathink.train.deepspeed_engine import ds_config, safe_checkpoint_engine, skip_shared_memory_op


def test_config_is_generated_from_train_params():
    cfg = TrainConfig(batch_size=4, grad_accum=3, grad_clip=0.5, backend="deepspeed",
                      deepspeed={"zero_stage": 3, "offload_optimizer": True, "offload_params": True})
    config = ds_config(cfg, "bf16", world_size=2)
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"],
            config["train_batch_size"], config["gradient_clipping"]) == (3, 2, 12, 0.5)  # 12 = 4 × 3, 6 per rank
    assert config["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                           "offload_param": {"device": "cpu"}}
    # No gradient reduced in bf16 (DeepSpeed's default would tag every Linear's), as under DDP and FSDP.
    assert config["torch_autocast"] == {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}
    assert "fp16" not in config
    fp32 = ds_config(TrainConfig(backend="deepspeed"), "fp32", world_size=1)
    assert "torch_autocast" not in fp32 and "fp16" not in fp32 and fp32["zero_optimization"] == {"stage": 2}
    assert ds_config(TrainConfig(backend="deepspeed"), "fp16", world_size=1)["fp16"] == {"enabled": True,
                                                                                          "loss_scale": 0}


@pytest.mark.parametrize("settings, message", [
    ({"optimizer": "muon"}, "optimizer muon needs whole 2-D matrices"),
    ({"compile": True}, "compile is not supported with backend deepspeed"),
    ({"deepspeed": {"offload_params": True}}, "offload_params needs zero_stage 3"),
    ({"deepspeed": {"zero_stage": 4}}, "less than or equal to 3"),
])
def test_impossible_combinations_fail_before_any_work(settings, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(backend="deepspeed", **settings)


class NotAllowed:
    """Stands for any object a tampered checkpoint could smuggle in to run code on load."""


def test_checkpoint_loader_allows_deepspeed_state_and_refuses_other_objects(tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import LossScaler

    engine = safe_checkpoint_engine()
    good = tmp_path / "optim_states.pt"
    torch.save({"loss_scaler": LossScaler(1.0), "state": {"exp_avg": torch.ones(3)}}, good)
    loaded = engine.load(str(good))
    assert isinstance(loaded["loss_scaler"], LossScaler) and torch.equal(loaded["state"]["exp_avg"], torch.ones(3))

    bad = tmp_path / "tampered.pt"
    torch.save({"payload": NotAllowed()}, bad)
    with pytest.raises(pickle.UnpicklingError, match="NotAllowed"):
        engine.load(str(bad))


def test_a_zero_stage_saved_by_a_python_that_pickles_enums_by_name_loads(tmp_path, monkeypatch):
    """Python 3.11.0-3.11.4 pickle an Enum member as getattr(class, name), which the weights_only loader refuses;
    DeepSpeed's optimizer checkpoints hold a ZeroStageEnum. That Python's pickling is put on the class here, and the
    engine's setup must replace it with pickling by value (a clone on Debian 12's Python 3.11.2 failed every ZeRO
    resume without it)."""
    from deepspeed.runtime.zero.config import ZeroStageEnum

    monkeypatch.setattr(ZeroStageEnum, "__reduce_ex__", lambda member, protocol: (getattr, (type(member), member.name)),
                        raising=False)
    assert b"getattr" in pickle.dumps(ZeroStageEnum.optimizer_states)  # as that Python writes it
    engine = safe_checkpoint_engine()
    saved = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"zero_stage": ZeroStageEnum.gradients, "state": torch.ones(2)}, saved)
    loaded = engine.load(str(saved))
    assert loaded["zero_stage"] is ZeroStageEnum.gradients and torch.equal(loaded["state"], torch.ones(2))


def test_the_communication_backend_builds_no_shared_memory_op():
    """DeepSpeed's own builder, as its communication backend calls it at initialize: without the skip it compiles
    the op on a CPU (tens of seconds, a compiler needed) and returns the module; with it, nothing."""
    from deepspeed.comm.torch import build_shm_op

    skip_shared_memory_op()
    assert build_shm_op() is None
