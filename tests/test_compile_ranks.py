"""train.compile on two gloo ranks: torch.compile of the DDP-wrapped model and of the FSDP2-sharded one trains the
same steps as one eager process with the same global batch (compiled and eager single processes differ by ~1e-7 in
the loss and ~2e-6 in the weights after these steps). `train.compile: auto` compiles a GPU run of two
minutes or more (budget.COMPILE_PAYS_AFTER_SECONDS), so a job on several GPUs takes this path without being asked."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from test_distributed import LOSS_RTOL, WEIGHT_ATOL, history, tracking, train_stage, weights
from test_resume_kill import tiny_project

pytestmark = [pytest.mark.slow, pytest.mark.spawns]

STEPS = 8


def train_run(tmp: Path, name: str, on_two_ranks: bool, **train) -> Path:
    """The train stage, compiled unless `train` says otherwise, dense, 2 × 4 windows per step (as two ranks of 4
    read them), on two gloo ranks or one process; inductor writes its kernels into the run's own cache folder."""
    base = tiny_project(tmp, name)
    params = yaml.safe_load((base / "params.yaml").read_text())
    params["train"].update({"max_steps": STEPS, "compile": True, "batch_size": 4, "grad_accum": 2, "log_every": 1,
                            "select": "last", "attention": "torch", "schedule": "cosine", "ema_horizon": 0.0,
                            **train})  # no weight average: FSDP keeps none, and the runs are compared with one process
    params["model"]["dropout"] = 0.0  # compiled code draws dropout masks differently
    (base / "params.yaml").write_text(yaml.safe_dump(params))
    env = dict(tracking(tmp), TORCHINDUCTOR_CACHE_DIR=str(base / "inductor"))
    train_stage(base, env, on_two_ranks)
    return base


def compiled_kernels(base: Path) -> list[Path]:
    return [p for p in (base / "inductor").rglob("*.py") if p.is_file()]


@pytest.fixture(scope="module")
def one(tmp_path_factory) -> Path:
    return train_run(tmp_path_factory.mktemp("one"), "one", False, compile=False)


# FSDP's ranks run matmul attention, whose compiled causal softmax is an operator of its own (kernels.causal_softmax);
# in fp32 it computes what torch's kernel does in the one eager process.
@pytest.mark.parametrize("backend, attention", [("ddp", "torch"), ("fsdp", "matmul")])
def test_compiled_training_on_two_ranks_takes_one_eager_process_steps(one, backend, attention, tmp_path):
    two = train_run(tmp_path, backend, True, backend=backend, attention=attention)
    assert compiled_kernels(two) and not compiled_kernels(one)  # inductor generated code for the ranks' run only
    calls_the_operator = any("causal_softmax" in path.read_text() for path in compiled_kernels(two))
    assert calls_the_operator == (attention == "matmul")
    a, b = history(one), history(two)
    assert [h["step"] for h in a] == [h["step"] for h in b] == list(range(1, STEPS + 1))
    for x, y in zip(a, b):
        assert abs(x["train_loss"] - y["train_loss"]) <= LOSS_RTOL * x["train_loss"], x["step"]
    assert a[-1]["train_loss"] < a[0]["train_loss"] - 0.5  # it learned: the steps compared are real updates
    wa, wb = weights(one), weights(two)
    assert wa.keys() == wb.keys() and max((wa[k] - wb[k]).abs().max().item() for k in wa) < WEIGHT_ATOL
    assert all(torch.isfinite(t).all() for t in wb.values())
