"""Data parallel and sharded training on CPU: `torchrun --nproc_per_node=2 -m tasks.train` (gloo) with DDP, FSDP2
or DeepSpeed ZeRO-2 trains the same model as one process with the same global batch; FSDP and DeepSpeed runs resume
from their own checkpoints exactly. Every checkpoint of a DDP or ZeRO-2 run first checks that all ranks hold the
same weights (the run fails otherwise), the last one at the final step."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from test_resume_kill import ROOT, tiny_project


def set_train(base: Path, **train) -> None:
    params = yaml.safe_load((base / "params.yaml").read_text())
    params["train"].update(train, max_steps=20, threads=1)
    params["model"]["dropout"] = 0.0  # dropout masks are per process: the one thing data parallelism changes
    (base / "params.yaml").write_text(yaml.safe_dump(params))


def torchrun(base: Path, env: dict, port: int) -> None:
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
            f"--master_port={port}", "-m", "tasks.train", "--params", str(base / "params.yaml")]
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("single")
    base = tiny_project(tmp, "single")
    set_train(base, batch_size=8)
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{tmp / 'mlflow.db'}")
    done = subprocess.run([sys.executable, "-m", "tasks.train", "--params", str(base / "params.yaml")],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return base


@pytest.mark.parametrize("backend, port", [("ddp", 29517), ("fsdp", 29527), ("deepspeed", 29537)])
def test_two_processes_match_one_process_with_the_same_global_batch(single, tmp_path, backend, port):
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}")
    base = tiny_project(tmp_path, backend)
    set_train(base, batch_size=4, backend=backend)  # per rank: 2 × 4 = the same 8 windows per step
    torchrun(base, env, port)

    one = json.loads((single / "model" / "history.json").read_text())
    two = json.loads((base / "model" / "history.json").read_text())
    assert [h["step"] for h in one] == [h["step"] for h in two]
    for a, b in zip(one, two):
        assert abs(a["train_loss"] - b["train_loss"]) < 2e-3 * a["train_loss"]
        assert abs(a["val_loss"] - b["val_loss"]) < 2e-3 * a["val_loss"] if "val_loss" in a else True
    wa, wb = load_file(single / "model" / "model.safetensors"), load_file(base / "model" / "model.safetensors")
    assert wa.keys() == wb.keys() and max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-3
    # Only rank 0 wrote: one configuration folder, one directory per kept checkpoint.
    (folder,) = [p for p in (base / "ckpt").iterdir() if (p / "fingerprint.json").is_file()]
    assert sorted(p.name for p in folder.glob("step_*")) == ["step_00000015", "step_00000020"]

    if backend == "deepspeed":  # each rank's ZeRO shard of the optimizer state, in DeepSpeed's own format
        shards = sorted(p.name for p in (folder / "step_00000020" / "deepspeed" / "ds").glob("*optim_states.pt"))
        assert shards == ["zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]

    if backend != "ddp":  # a sharded run resumes from its step-15 checkpoint to the same weights
        shutil.rmtree(folder / "step_00000020")
        shutil.rmtree(base / "model")
        torchrun(base, env, port)
        again = load_file(base / "model" / "model.safetensors")
        assert json.loads((base / "model" / "train_summary.json").read_text())["resumed_from"] == 15
        assert all(torch_equal(wb[k], again[k]) for k in wb)


def torch_equal(a, b) -> bool:
    return bool((a == b).all())
