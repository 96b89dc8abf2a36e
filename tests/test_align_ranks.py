"""The align stage on two ranks (launch.nproc_per_node 2: gloo ranks the stage starts itself): DPO under DDP takes
the steps one process takes with the same params — the same global batch of pairs, each rank its half, every pair
weighing the same — from the same reference, and the main rank merges the adapters into the same plain model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from test_align import assets, cat_pair  # noqa: F401  (the fixture: a tiny model dir with its chat tokenizer)

pytestmark = [pytest.mark.slow, pytest.mark.spawns]

ROOT = Path(__file__).resolve().parents[1]
LOSS_RTOL, WEIGHT_ATOL = 1e-5, 1e-5


def align(model_dir: Path, tmp: Path, ranks: int) -> Path:
    out = tmp / f"ranks-{ranks}"
    out.mkdir()
    pairs = [{**p, "prompt": p["prompt"][0]["content"]} for p in map(cat_pair, range(48))]
    (out / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    params = {
        "paths": {"aligned_dir": str(out / "aligned"), "align_report": str(out / "align.json"),
                  "align_checkpoint_dir": str(out / "ckpt"), "align_plan": str(out / "plan.json")},
        "train": {"precision": "fp32", "attention": "torch", "threads": 1, "log_every": 1, "backend": "ddp"},
        "align": {"enabled": True, "init_from": str(model_dir), "data": str(out / "pairs.jsonl"), "max_steps": 10,
                  "batch_size": 8, "warmup_steps": 1, "eval_every": 5, "lr": 0.01, "beta": 0.5, "samples": 1,
                  "min_pairs": 20, "lora": {"r": 4, "alpha": 8.0, "dropout": 0.0}},
        "launch": {"nproc_per_node": ranks},
    }
    (out / "params.yaml").write_text(yaml.safe_dump(params))
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{out / 'mlflow.db'}")
    done = subprocess.run([sys.executable, "-m", "tasks.align", "--params", str(out / "params.yaml")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return out / "aligned"


def test_dpo_on_two_ranks_takes_one_process_steps(assets, tmp_path):  # noqa: F811
    one, two = align(assets, tmp_path, 1), align(assets, tmp_path, 2)
    alone, status = (json.loads((d / "align.json").read_text()) for d in (one, two))
    assert (alone["world_size"], status["world_size"], status["backend"], status["steps"]) == (1, 2, "ddp", 10)
    first, other = (json.loads((d / "model" / "history.json").read_text()) for d in (one, two))
    assert [h["step"] for h in first] == [h["step"] for h in other] == list(range(1, 11))
    for a, b in zip(first, other):
        assert abs(a["train_loss"] - b["train_loss"]) <= LOSS_RTOL * a["train_loss"], (a, b)
    assert first[-1]["train_loss"] < first[0]["train_loss"] - 0.2  # it learned: not two no-ops compared
    wa, wb = (load_file(d / "model" / "model.safetensors") for d in (one, two))
    assert wa.keys() == wb.keys() and not any("lora" in k for k in wb)  # merged into plain weights
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < WEIGHT_ATOL
    for key in ("align_reward_margin", "align_preference_bits"):
        assert status["metrics"][key] == pytest.approx(alone["metrics"][key], rel=1e-4)
