"""Helpers of the end-to-end tests: a git + DVC copy of this project with tiny params, commands run in it with the
project's virtualenv first on PATH, and one trained copy per test run, shared by the xdist workers (`trained_project`
in conftest.py), that tests copy instead of training their own."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlflow
import yaml
from mlflow.tracking import MlflowClient

ROOT = Path(__file__).resolve().parents[1]
TINY = {
    "data": {"max_samples": 400},
    "validate": {"min_rows": 50},
    "tokenizer": {"vocab_size": 320},
    # No q/k norms: with heads of 16 dimensions they cap attention logits at |q||k|/√16 = 4 until the norms' weights
    # grow, and 200 steps are too few for that (the chat fine-tune then answered nothing); the default models' heads
    # are 48-64 wide. tests/test_model.py and test_export.py cover q/k norms. Dropout 0.1 (the default is 0): 200
    # steps at lr 0.01 are dozens of epochs of these 400 documents, and without it the model overfits (the built-in
    # task's accuracy fell from 0.29 to 0.25; the downstream test now trains a larger model of its own for that task).
    "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "seq_len": 32, "qk_norm": False,
              "dropout": 0.1},
    # 200 steps (about a second): enough to beat the unigram baseline on the held-out text (val 4.314 vs 4.407
    # nats; 12 steps reached 4.576, 100 steps 4.387), which the pipeline test requires of a trained model. Cosine,
    # not the default WSD: a warm start from this model then gains 0.38 nats at equal steps (3.935 vs 4.314).
    "train": {"max_steps": 200, "batch_size": 4, "warmup_steps": 2, "eval_every": 100, "eval_batches": 2,
              "checkpoint_every": 100, "log_every": 100, "lr": 0.01, "schedule": "cosine"},
    "evaluate": {"prompts": ["The"], "max_new_tokens": 8, "batch_size": 8},
}


def sh(args: list[str], cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env.pop("MLFLOW_TRACKING_URI", None)  # each copy uses its own sqlite registry
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True)
    if check and done.returncode:
        raise AssertionError(f"{args} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done


def set_params(project: Path, changes: dict) -> None:
    path = project / "params.yaml"
    params = yaml.safe_load(path.read_text())
    for section, values in changes.items():
        params.setdefault(section, {}).update(values)
    path.write_text(yaml.safe_dump(params, sort_keys=False))


def make_project(tmp: Path, tiny: bool = True) -> Path:
    """A git + DVC checkout of this project's tracked files, with tiny params (or, `tiny` false, the shipped ones)."""
    project = tmp / "project"
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        if (ROOT / name).is_file():
            (project / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, project / name)
    if tiny:
        set_params(project, TINY)
    sh(["git", "init", "-q"], project)
    sh(["git", "add", "-A"], project)
    sh(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init"], project)
    return project


def client_for(project: Path) -> MlflowClient:
    uri = f"sqlite:///{project / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    return MlflowClient(uri, uri)


def ran_stages(output: str) -> list[str]:
    return [line.split("'")[1] for line in output.splitlines() if line.startswith("Running stage")]


def train_baseline(tmp: Path) -> Path:
    """A project after one full `dvc repro`, committed: every stage ran, v1 is champion."""
    project = make_project(tmp)
    first = sh(["dvc", "repro"], project)
    assert ran_stages(first.stdout) == ["validate", "tokenizer", "prepare", "train", "evaluate", "promote", "finetune",
                                       "promote_finetuned", "align", "promote_aligned"]
    sh(["git", "add", "-A"], project)
    sh(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "baseline run"], project)
    return project


def copy_project(baseline: Path, tmp: Path) -> Path:
    """A copy of a trained project. The store's experiment keeps the baseline's artifact folder (an absolute path),
    so the copy's new runs write their files there: fine for a test, nothing reads them across copies."""
    copy = tmp / "project"
    shutil.copytree(baseline, copy, symlinks=True)
    return copy
