"""A training process killed with SIGKILL and started again ends with the same weights, bit for bit, as one that
was never interrupted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from safetensors.torch import load_file

pytestmark = [pytest.mark.slow, pytest.mark.spawns]  # three training processes, one of them killed

ROOT = Path(__file__).resolve().parents[1]
STEPS = 40


def tiny_project(tmp: Path, name: str) -> Path:
    """Prepared tokens and a params file whose paths all point inside `tmp/name`."""
    base = tmp / name
    prepared = base / "prepared"
    prepared.mkdir(parents=True)
    rng = np.random.default_rng(0)
    splits = {"train": np.resize(rng.integers(0, 64, 41), 6000), "val": np.resize(rng.integers(0, 64, 41), 800)}
    meta = {"dtype": "uint16", "vocab_size": 64, "eos_id": 0}
    for split, tokens in splits.items():
        tokens.astype(np.uint16).tofile(prepared / f"{split}.bin")
        meta[split] = {"tokens": len(tokens), "bytes": 4 * len(tokens), "documents": 1}
    (prepared / "meta.json").write_text(json.dumps(meta))
    (base / "validate.json").write_text("{}")
    params = {
        "paths": {"prepared_dir": str(prepared), "validate_report": str(base / "validate.json"),
                  "checkpoint_dir": str(base / "ckpt"), "model_dir": str(base / "model"),
                  "train_plan": str(base / "plan.json"), "train_run": str(base / "train_run.json")},
        "model": {"d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "seq_len": 32, "dropout": 0.1},
        "train": {"max_steps": STEPS, "batch_size": 8, "warmup_steps": 4, "eval_every": 10, "eval_batches": 2,
                  "checkpoint_every": 5, "log_every": 5, "precision": "fp32", "threads": 1},
    }
    (base / "params.yaml").write_text(yaml.safe_dump(params))
    return base


def train(base: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tasks.train", "--params", str(base / "params.yaml")], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_sigkill_then_resume_is_bitwise_identical(tmp_path):
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}")
    straight = tiny_project(tmp_path, "straight")
    assert train(straight, env).wait(timeout=300) == 0

    killed = tiny_project(tmp_path, "killed")
    proc = train(killed, env)
    deadline = time.monotonic() + 240
    while not any((killed / "ckpt").glob("*/step_00000010")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (killed / "model").exists(), "the run finished before it could be killed"

    resumed = train(killed, env)
    output = resumed.communicate(timeout=300)[0]
    assert resumed.returncode == 0, output
    assert "resumed from" in output
    step = int(output.split("resumed from")[1].split("at step")[1].split()[0])
    assert 10 <= step < STEPS

    a = load_file(straight / "model" / "model.safetensors")
    b = load_file(killed / "model" / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    # Its validation text is another cycle than its training text: past its best validation both runs find a
    # plateau, go back to that step and decay from there (train.decay_patience), the killed one after its resume.
    summary = json.loads((killed / "model" / "train_summary.json").read_text())
    assert summary["decay_began"] is not None and summary["steps"] < STEPS
    assert json.loads((killed / "train_run.json").read_text())["resumed_from"] == step
    # What the model directory holds is what the inputs determine: the same bytes, killed or not.
    for name in ("history.json", "train_summary.json", "lineage.json", "config.json"):
        assert (straight / "model" / name).read_bytes() == (killed / "model" / name).read_bytes(), name
