"""End to end, with the real tools: `dvc repro` and the Prefect flow run every stage on a tiny config in a temporary
copy of the project; the champion is loaded back from the MLflow registry and generates text."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
import yaml

from e2e_helpers import client_for, copy_project, make_project, ran_stages, set_params, sh

pytestmark = [pytest.mark.slow, pytest.mark.spawns]  # `dvc repro`, `dvc exp`, Prefect flows: minutes


@pytest.fixture(scope="module")
def repro_project(trained_project, tmp_path_factory) -> Path:
    """This module's own copy of the trained project; its tests change it in order."""
    return copy_project(trained_project, tmp_path_factory.mktemp("repro"))


def test_repro_registers_a_champion_that_generates(repro_project):
    decision = json.loads((repro_project / "reports/promotion.json").read_text())
    assert decision["promoted"] and decision["version"] == 1
    metrics = json.loads((repro_project / "reports/metrics.json").read_text())
    # The trained model beats the unigram baseline (token frequencies alone), in nats per token and bits per byte.
    figures = {k: round(metrics[k], 4) for k in ("val_loss", "unigram_loss", "val_bpb", "unigram_bpb")}
    assert metrics["val_loss"] < metrics["unigram_loss"] and 0 < metrics["val_bpb"] < metrics["unigram_bpb"], figures
    client = client_for(repro_project)
    version = client.get_model_version_by_alias("ultrathink", "champion")
    assert version.version == 1 and version.tags["git_commit"] != "unknown" and "params_hash" in version.tags
    model = mlflow.pyfunc.load_model("models:/ultrathink@champion")
    out = model.predict(["The", "A"], params={"temperature": 0.0, "max_new_tokens": 5})
    assert len(out) == 2 and all(isinstance(text, str) for text in out)


def test_unchanged_inputs_skip_every_stage(repro_project):
    assert "up to date" in sh(["dvc", "status"], repro_project).stdout
    assert ran_stages(sh(["dvc", "repro"], repro_project).stdout) == []


def test_worse_moe_model_reruns_only_downstream_and_keeps_champion(repro_project):
    set_params(repro_project, {"model": {"d_model": 16, "moe": {"enabled": True, "every": 1}},
                               "train": {"max_steps": 2, "warmup_steps": 1}})
    done = sh(["dvc", "repro"], repro_project)
    # finetune and align (both off) take train.* (they train with its optimizer and precision): they run again.
    assert ran_stages(done.stdout) == ["train", "evaluate", "promote", "finetune", "align"]
    assert "moe=[entropy=" in done.stdout + done.stderr
    decision = json.loads((repro_project / "reports/promotion.json").read_text())
    assert decision["version"] == 2 and not decision["promoted"]
    client = client_for(repro_project)
    assert client.get_model_version_by_alias("ultrathink", "champion").version == 1
    challenger = client.get_model_version_by_alias("ultrathink", "challenger")
    assert challenger.version == 2
    assert {"moe_entropy", "moe_max_expert_share"} <= client.get_run(challenger.run_id).data.metrics.keys()


def test_dvc_experiment_turns_on_the_reasoning_engine(repro_project):
    # Three steps, one of warmup: the last step routes (the step line reports what the step did: path=warmup
    # while warming up).
    knobs = ["train.lr=0.02", "train.max_steps=3", "model.moe.enabled=false", "model.dre.enabled=true",
             "model.dre.every=1", "model.dre.warmup_steps=1"]
    done = sh(["dvc", "exp", "run", *[arg for knob in knobs for arg in ("-S", knob)]], repro_project)
    assert ran_stages(done.stdout) == ["train", "evaluate", "promote", "finetune", "align"]
    assert "dre=[path=standard,kept=" in done.stdout + done.stderr
    assert yaml.safe_load((repro_project / "params.yaml").read_text())["train"]["lr"] == 0.02
    assert len(sh(["dvc", "exp", "list", "--name-only"], repro_project).stdout.split()) == 1
    assert json.loads((repro_project / "reports/promotion.json").read_text())["version"] == 3


def test_corrupt_corpus_stops_at_validate_without_a_new_version(repro_project):
    before = len(client_for(repro_project).search_model_versions("name='ultrathink'"))
    (repro_project / "data/raw/broken.jsonl").write_text('{"text": null}\n' * 60)
    set_params(repro_project, {"data": {"source": "data/raw/broken.jsonl", "max_samples": None}})
    failed = sh(["dvc", "repro"], repro_project, check=False)
    assert failed.returncode != 0
    assert ran_stages(failed.stdout) == ["validate"]
    assert "text not null" in failed.stdout + failed.stderr and "60" in failed.stdout + failed.stderr
    assert len(client_for(repro_project).search_model_versions("name='ultrathink'")) == before


def test_bad_params_fail_before_any_work(repro_project, tmp_path):
    bad = tmp_path / "params.yaml"
    bad.write_text("train:\n  lr: -1\n")
    done = sh([sys.executable, "-m", "tasks.train", "--params", str(bad)], repro_project, check=False)
    assert done.returncode == 2 and "train.lr: Input should be greater than 0" in done.stderr


def test_prefect_flow_trains_a_jsonl_folder_then_skips(tmp_path):
    """The flow on the user's own data: a folder of JSONL shards."""
    from ultrathink.config import DataConfig
    from ultrathink.data.sources import load_corpus
    from ultrathink.pipeline import stage_order

    project = make_project(tmp_path)
    texts = list(load_corpus(DataConfig(max_samples=400))["text"])
    for shard in range(2):
        rows = (json.dumps({"body": t}) for t in texts[shard::2])
        (project / f"data/raw/shard-{shard}.jsonl").write_text("\n".join(rows) + "\n")
    set_params(project, {"data": {"source": "data/raw/shard-*.jsonl", "text_column": "body", "max_samples": None}})
    stages = len(stage_order(project))  # every stage of dvc.yaml, the post-training ones (off) included
    first = sh([sys.executable, "-m", "flows.pipeline"], project)
    log = first.stdout + first.stderr
    assert log.count("ran in") == stages == 10, log[-3000:]
    assert "up to date" in sh(["dvc", "status"], project).stdout
    second = sh([sys.executable, "-m", "flows.pipeline"], project)
    assert (second.stdout + second.stderr).count("up to date, skipped") == stages
    assert client_for(project).get_model_version_by_alias("ultrathink", "champion").version == 1


def test_prefect_deploy_accepts_the_nightly_deployment(tmp_path):
    project = make_project(tmp_path)
    home = {"PREFECT_HOME": str(tmp_path / "prefect-home")}
    env = dict(os.environ, **home, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    run = lambda *args: subprocess.run(["prefect", *args], cwd=project, env=env, capture_output=True, text=True)
    assert run("work-pool", "create", "ultrathink-local", "--type", "process").returncode == 0
    deployed = run("--no-prompt", "deploy", "--all")
    assert deployed.returncode == 0, deployed.stdout[-2000:] + deployed.stderr[-2000:]
    assert "ultrathink-pipeline/nightly-retrain" in deployed.stdout and "successfully created" in deployed.stdout
    shown = run("deployment", "inspect", "ultrathink-pipeline/nightly-retrain")
    assert "0 2 * * *" in shown.stdout
