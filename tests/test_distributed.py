"""Data parallel on CPU: `torchrun --nproc_per_node=2 -m tasks.train` (gloo) trains the same model as one process
with the same global batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml
from safetensors.torch import load_file

from test_resume_kill import ROOT, tiny_project


def set_train(base: Path, **train) -> None:
    params = yaml.safe_load((base / "params.yaml").read_text())
    params["train"].update(train, max_steps=20, threads=1)
    params["model"]["dropout"] = 0.0  # dropout masks are per process: the one thing DDP cannot reproduce
    (base / "params.yaml").write_text(yaml.safe_dump(params))


def test_ddp_two_processes_match_one_process_with_the_same_global_batch(tmp_path):
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}")
    single, ddp = tiny_project(tmp_path, "single"), tiny_project(tmp_path, "ddp")
    set_train(single, batch_size=8)
    set_train(ddp, batch_size=4)  # per rank: 2 × 4 = the same 8 windows per step
    done = subprocess.run([sys.executable, "-m", "tasks.train", "--params", str(single / "params.yaml")],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
                "--master_port=29517", "-m", "tasks.train", "--params", str(ddp / "params.yaml")]
    done = subprocess.run(torchrun, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]

    one = json.loads((single / "model" / "history.json").read_text())
    two = json.loads((ddp / "model" / "history.json").read_text())
    assert [h["step"] for h in one] == [h["step"] for h in two]
    for a, b in zip(one, two):
        assert abs(a["train_loss"] - b["train_loss"]) < 2e-3 * a["train_loss"]
        assert abs(a["val_loss"] - b["val_loss"]) < 2e-3 * a["val_loss"] if "val_loss" in a else True
    wa, wb = load_file(single / "model" / "model.safetensors"), load_file(ddp / "model" / "model.safetensors")
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-3
    # Only rank 0 wrote: one checkpoint directory per saved step, one MLflow run.
    assert sorted(p.name for p in (ddp / "ckpt").glob("step_*")) == ["step_00000015", "step_00000020"]
