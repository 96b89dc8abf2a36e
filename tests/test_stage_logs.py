"""Per-stage log files with a level knob, and TensorBoard scalars beside MLflow (train.tensorboard)."""

import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from e2e_helpers import TINY, client_for, make_project, set_params, sh

pytestmark = [pytest.mark.slow, pytest.mark.spawns]


def test_train_writes_tensorboard_scalars_and_each_stage_its_log_file(tmp_path):
    project = make_project(tmp_path)
    set_params(project, {"train": {"tensorboard": True, "precision": "auto"}})
    for stage in ("validate", "tokenizer", "prepare", "train"):
        sh([sys.executable, "-m", f"tasks.{stage}"], project)
    client = client_for(project)
    (run,) = client.search_runs([client.get_experiment_by_name("ultrathink").experiment_id])
    events = EventAccumulator(str(project / "reports" / "tensorboard" / run.info.run_id))
    events.Reload()
    board = [(e.step, e.value) for e in events.Scalars("train_loss")]
    tracked = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train_loss")]
    board, tracked = sorted(board), sorted(tracked)
    assert [s for s, _ in board] == [s for s, _ in tracked] == list(range(1, TINY["train"]["max_steps"] + 1))  # every step
    assert [v for _, v in board] == pytest.approx([v for _, v in tracked])  # the same values
    assert {"lr", "grad_norm", "tokens_per_second"} <= set(events.Tags()["scalars"])

    logs = project / "reports" / "logs"
    assert sorted(p.name for p in logs.iterdir()) == ["prepare.log", "tokenizer.log", "train.log", "validate.log"]
    assert "precision auto →" in (logs / "train.log").read_text()  # an INFO line, at the default level

    # logging.level WARNING keeps INFO lines out of the file and stderr; the file is appended to, not replaced.
    before = (logs / "train.log").read_text()
    done = sh([sys.executable, "-m", "tasks.train", "--set", "logging.level=WARNING", "--set", "train.resume=false"],
              project)
    after = (logs / "train.log").read_text()
    assert after.startswith(before) and "precision auto →" not in after[len(before):]
    assert "starting over" in after[len(before):] and "precision auto →" not in done.stderr
