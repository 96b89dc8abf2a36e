"""train.decay_patience on two gloo ranks. Half of the validation windows are the training text's cycle and half
another cycle, so the validation loss falls while the model learns the first and then rises as it grows sure of
it (here best at step 32, worse at 36, in the second epoch): the run goes back to step 32's checkpoint and decays from
there. On DDP, FSDP and DeepSpeed ZeRO-2 ranks it does so at the same step as one process with the same global
batch, and takes the same path from there (within the backends' reduction-order rounding)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from test_distributed import LOSS_RTOL, WEIGHT_ATOL, history, tracking, train_stage, weights
from test_resume_kill import tiny_project

pytestmark = [pytest.mark.slow, pytest.mark.spawns]


def plateau_run(tmp: Path, name: str, on_two_ranks: bool, **train) -> Path:
    """The train stage with train.decay_patience 1, dense, 2 × 4 windows per step (as two ranks of 4 read them;
    an epoch of the training text is 23 steps), validated and checkpointed every 4 steps."""
    base = tiny_project(tmp, name)
    rng = np.random.default_rng(0)  # the training text's cycle, as tiny_project drew it, then another
    learned, unseen = np.resize(rng.integers(0, 64, 41), 800), np.resize(rng.integers(0, 64, 41), 800)
    val = np.where((np.arange(800) // 32) % 2 == 0, learned, unseen)  # windows of 32 from each in turn
    val.astype(np.uint16).tofile(base / "prepared" / "val.bin")
    params = yaml.safe_load((base / "params.yaml").read_text())
    params["train"].update({"max_steps": 80, "batch_size": 4, "grad_accum": 2, "eval_every": 4,
                            "checkpoint_every": 4, "log_every": 1, "decay_patience": 1, "select": "best",
                            "attention": "torch", "schedule": "wsd", "ema_horizon": 0.0, **train})
    # ema_horizon 0: FSDP and DeepSpeed keep no weight average, and every run is compared with one process's
    params["model"]["dropout"] = 0.0  # dropout masks are per process
    (base / "params.yaml").write_text(yaml.safe_dump(params))
    env = tracking(tmp)
    train_stage(base, env, on_two_ranks)
    return base


def summary(base: Path) -> dict:
    return json.loads((base / "model" / "train_summary.json").read_text())


@pytest.fixture(scope="module")
def one(tmp_path_factory) -> Path:
    return plateau_run(tmp_path_factory.mktemp("one"), "one", False)


@pytest.mark.parametrize("backend", ["ddp", "fsdp", "zero2"])
def test_a_plateau_on_two_ranks_goes_back_where_one_process_does(one, backend, tmp_path):
    settings = {"backend": "deepspeed", "deepspeed": {"zero_stage": 2}} if backend == "zero2" else {"backend": backend}
    two = plateau_run(tmp_path, backend, True, **settings)
    a, b = summary(one), summary(two)
    assert a["decay_began"] is not None and a["steps"] < 80  # a plateau was found and the run ended early
    assert (b["decay_began"], b["steps"], b["selected_step"]) == (a["decay_began"], a["steps"], a["selected_step"])
    x, y = history(one), history(two)
    assert [h["step"] for h in x] == [h["step"] for h in y] == list(range(1, a["steps"] + 1))
    for p, q in zip(x, y):
        assert abs(p["train_loss"] - q["train_loss"]) <= LOSS_RTOL * p["train_loss"], p["step"]
    wa, wb = weights(one), weights(two)
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < WEIGHT_ATOL
    (folder,) = [p for p in (two / "ckpt").iterdir() if (p / "fingerprint.json").is_file()]
    steps = sorted(int(p.name.split("_")[1]) for p in folder.glob("step_*"))
    assert steps and max(steps) == a["steps"]  # none of the steps it went back over
