"""Scale-out from params.yaml: `dvc repro` with launch.nproc_per_node 2 pretrains and fine-tunes on the two ranks the
train and finetune stages start themselves (no torchrun, no edit of dvc.yaml), and a rank that fails stops the chain
with that rank's own error, with nothing promoted. (Resuming on another number of ranks: tests/test_distributed.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from e2e_helpers import client_for, copy_project, ran_stages, set_params
from ultrathink.config import ParamsError, load_params

# Rank 1 of a launched run dies at its third step, as a rank whose disk or GPU fails would; rank 0 is left waiting in
# the step's all-reduce. Loaded by every Python process through PYTHONPATH; it acts only in launched rank 1.
FAULT = '''
import os
if os.environ.get("RANK") == "1" and os.environ.get("TORCHELASTIC_ERROR_FILE"):
    from ultrathink.train import trainer

    taken = trainer.Trainer.train_step

    def train_step(self):
        if self.step == 2:
            raise OSError("rank 1 lost its scratch disk")
        return taken(self)

    trainer.Trainer.train_step = train_step
'''


def dvc(project: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(env or os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env.pop("MLFLOW_TRACKING_URI", None)
    return subprocess.run(["dvc", *args], cwd=project, env=env, capture_output=True, text=True)


@pytest.mark.slow
@pytest.mark.spawns
def test_dvc_repro_trains_and_fine_tunes_on_the_ranks_params_ask_for_and_a_failing_rank_stops_the_chain(trained_project, tmp_path):
    project = copy_project(trained_project, tmp_path)
    steps = yaml.safe_load((project / "params.yaml").read_text())["train"]["max_steps"]
    set_params(project, {"launch": {"nproc_per_node": 2}, "train": {"max_steps": steps + 20}})
    registered = len(client_for(project).search_model_versions("name='ultrathink'"))
    decision = (project / "reports/promotion.json").read_text()

    (tmp_path / "fault").mkdir()
    (tmp_path / "fault" / "sitecustomize.py").write_text(FAULT)
    failed = dvc(project, "repro", "promote", env=dict(os.environ, PYTHONPATH=str(tmp_path / "fault")))
    assert failed.returncode != 0
    output = failed.stdout + failed.stderr
    assert "train failed: rank 1 (exit code 1): OSError: rank 1 lost its scratch disk" in output, output[-3000:]
    assert "evaluate" not in ran_stages(failed.stdout) and "promote" not in ran_stages(failed.stdout)
    assert len(client_for(project).search_model_versions("name='ultrathink'")) == registered
    assert (project / "reports/promotion.json").read_text() == decision

    # The same `dvc repro`, the fault gone and fine-tuning on: both training stages run on the two ranks.
    set_params(project, {"finetune": {"enabled": True, "max_steps": 6, "batch_size": 8, "warmup_steps": 1,
                                      "eval_every": 3, "samples": 1}})
    done = dvc(project, "repro")
    assert done.returncode == 0, done.stderr[-3000:]
    # align (off) follows the fine-tuned champion; its output, "off", is unchanged, so promote_aligned is not run.
    assert ran_stages(done.stdout) == ["train", "evaluate", "promote", "finetune", "promote_finetuned", "align"]
    summary = json.loads((project / "artifacts/model/train_summary.json").read_text())
    assert (summary["world_size"], summary["backend"], summary["steps"]) == (2, "ddp", steps + 20)
    finetuned = json.loads((project / "artifacts/finetuned/finetune.json").read_text())
    assert (finetuned["world_size"], finetuned["backend"], finetuned["steps"]) == (2, "ddp", 6)
    assert json.loads((project / "reports/finetune_promotion.json").read_text())["version"] >= 1
    assert dvc(project, "status").stdout.strip() == "Data and pipelines are up to date."


def test_launch_settings_are_checked_naming_the_key(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"launch": {"nproc_per_node": 2, "nnodes": 2}}))
    with pytest.raises(ParamsError, match="launch.nnodes > 1 needs launch.rdzv_endpoint"):
        load_params(params)
    with pytest.raises(ParamsError, match="launch.node_rank 2 must be below launch.nnodes 2"):
        load_params(params, ["launch.rdzv_endpoint=10.0.0.1:29500", "launch.node_rank=2"])
    assert load_params(params, ["launch.rdzv_endpoint=10.0.0.1:29500"]).launch.world_size == 4
