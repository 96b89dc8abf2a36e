"""The pipeline's promises under the changes users make next, end to end with real DVC and MLflow (SQLite):
change the code, switch the data and back, change a knob and go back, warm start from the champion, score the same
text two ways, and sweep with queued DVC experiments into the project's one store.

Each test works on its own copy of the session's trained project (conftest.trained_project: a `dvc repro` of the tiny
pipeline), so they pass alone and in any order."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from e2e_helpers import TINY, client_for, copy_project, make_project, ran_stages, set_params, sh

# Several minutes of real DVC runs: run by `make test`; `-m "not slow"` (or `-m "not spawns"`) skips them.
pytestmark = [pytest.mark.slow, pytest.mark.spawns]

STEPS, EVERY = TINY["train"]["max_steps"], TINY["train"]["checkpoint_every"]  # the trained project's run


@pytest.fixture
def project(trained_project, tmp_path) -> Path:
    return copy_project(trained_project, tmp_path)


@pytest.fixture(scope="module")
def read_only(trained_project, tmp_path_factory) -> Path:
    """One copy shared by the tests that only read the trained project."""
    return copy_project(trained_project, tmp_path_factory.mktemp("read_only"))


def metrics(project: Path) -> dict:
    return json.loads((project / "reports/metrics.json").read_text())


def decision(project: Path) -> dict:
    return json.loads((project / "reports/promotion.json").read_text())


def weights(project: Path) -> dict:
    return load_file(project / "artifacts/model/model.safetensors")


def test_a_code_change_retrains_and_never_publishes_the_old_weights(project):
    before, champion_bpb = weights(project), metrics(project)["val_bpb"]
    model_py = project / "ultrathink/model/model.py"
    source = model_py.read_text()
    # The MLP's activation: one line of the model's math.
    edited = source.replace("return F.silu(gate) * up", "return F.gelu(gate) * up")
    assert edited != source, "the MLP line to edit was not found"
    model_py.write_text(edited)
    done = sh(["dvc", "repro"], project)
    # Every stage that runs the model's code: promote_finetuned and promote_aligned score chat models with it.
    assert ran_stages(done.stdout) == ["train", "evaluate", "promote", "finetune", "promote_finetuned", "align",
                                       "promote_aligned"]
    log = done.stdout + done.stderr
    assert "not resuming from" in log and "made with other code" in log
    summary = json.loads((project / "artifacts/model/train_summary.json").read_text())
    assert summary["steps"] == STEPS
    assert json.loads((project / "reports/train_run.json").read_text())["resumed_from"] is None
    after = weights(project)
    assert any(not (before[k] == after[k]).all() for k in before)
    # The champion was judged under its own code (the snapshot logged with it), not under the edited MLP:
    # on the same text it scores exactly what it scored when it was registered.
    judged = decision(project)
    assert judged["previous_champion_version"] == 1
    assert judged["previous_value"] == pytest.approx(champion_bpb, rel=1e-6)
    # The first configuration's checkpoints are still there, next to the new one's.
    folders = [p for p in (project / "artifacts/checkpoints").iterdir() if (p / "fingerprint.json").is_file()]
    assert len(folders) == 2 and all(any(f.glob("step_*")) for f in folders)


def test_a_detour_to_another_corpus_and_back_lets_the_real_model_win_again(project):
    easy = [f"item {i % 7} is in box {i % 3}." for i in range(400)]
    (project / "data/raw/easy.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in easy))
    real_params = (project / "params.yaml").read_text()
    set_params(project, {"data": {"source": "data/raw/easy.jsonl", "max_samples": None, "dedup": False},
                         "validate": {"max_duplicate_fraction": 1.0}})
    sh(["dvc", "repro"], project)
    detour = decision(project)
    assert detour["version"] == 2 and detour["yardstick"]["sha256"] != ""
    # Compared on the easy corpus' own validation text: the easy model wins there, and only there.
    assert detour["promoted"] and detour["previous_value"] > detour["value"]

    (project / "params.yaml").write_text(real_params)
    done = sh(["dvc", "repro"], project)
    # DVC brings the real-data model back from its run-cache; promotion is never restored, it judges again. The
    # same weights from the same run are the same registered version (v1), not a copy.
    assert "promote" in ran_stages(done.stdout)
    back = decision(project)
    assert back["version"] == 1 and back["promoted"], back
    assert back["previous_champion_version"] == 2 and back["previous_value"] > back["value"]
    assert back["yardstick"]["sha256"] == metrics(project)["yardstick_sha256"] != detour["yardstick"]["sha256"]
    assert int(client_for(project).get_model_version_by_alias("ultrathink", "champion").version) == 1


def test_a_longer_budget_trains_a_larger_auto_vocabulary_and_prepares_again_only_when_it_changes(tmp_path):
    """Under tokenizer.vocab_size auto the tokenizer stage takes train.budget (a run of a minute or more gets twice
    the tokens) and, for such a time budget, train.precision (in fp32, half as many again); a change that leaves the
    tokenizer as it was leaves the prepared tokens as they were."""
    project = make_project(tmp_path)
    set_params(project, {"data": {"max_samples": None}, "tokenizer": {"vocab_size": "auto"},
                         "train": {"budget": "30s", "precision": "bf16"}})

    def prepare() -> tuple[list[str], int]:
        done = sh(["dvc", "repro", "prepare"], project)
        return ran_stages(done.stdout), json.loads((project / "data/prepared/meta.json").read_text())["vocab_size"]

    assert prepare() == (["validate", "tokenizer", "prepare"], 320)
    set_params(project, {"train": {"budget": "2min"}})
    assert prepare() == (["tokenizer", "prepare"], 576)
    set_params(project, {"train": {"precision": "fp32"}})
    assert prepare() == (["tokenizer", "prepare"], 832)
    set_params(project, {"train": {"budget": "5min"}})
    assert prepare() == (["tokenizer"], 832)


def test_a_longer_schedule_keeps_earlier_checkpoints_and_going_back_resumes(project):
    first = {p.name for p in (project / "artifacts/checkpoints").iterdir()}
    done = sh(["dvc", "exp", "run", "-S", f"train.max_steps={STEPS + EVERY}"], project)
    assert ran_stages(done.stdout)[:1] == ["train"]
    folders = {p.name for p in (project / "artifacts/checkpoints").iterdir()}
    assert first < folders  # a new folder beside the first, which is intact
    (original,) = [project / "artifacts/checkpoints" / name for name in first if not name.startswith(".")]
    assert sorted(p.name for p in original.glob("step_*")) == [f"step_{EVERY:08d}", f"step_{STEPS:08d}"]
    set_params(project, {"train": {"max_steps": STEPS}})
    back = sh(["python", "-m", "tasks.train"], project)
    assert "resumed from" in back.stderr and f"at step {STEPS}" in back.stderr
    summary = json.loads((project / "artifacts/model/train_summary.json").read_text())
    assert summary["steps"] == STEPS
    assert json.loads((project / "reports/train_run.json").read_text())["resumed_from"] == STEPS


def test_warm_start_from_the_champion_beats_a_cold_start_at_equal_steps(project):
    cold = metrics(project)["val_loss"]  # the baseline: STEPS steps from a random init
    champion = client_for(project).get_model_version_by_alias("ultrathink", "champion")
    done = sh(["dvc", "exp", "run", "-S", "train.init_from=models:/ultrathink@champion"], project)
    assert ran_stages(done.stdout) == ["train", "evaluate", "promote", "finetune", "align"]
    assert "warm start from models:/ultrathink@champion" in done.stderr
    warm = metrics(project)["val_loss"]
    assert warm < cold - 0.05, (warm, cold)
    version = client_for(project).get_model_version("ultrathink", str(decision(project)["version"]))
    assert version.tags["parent_model"] == f"models:/ultrathink/{champion.version}"
    assert version.tags["parent_sha256"] == json.loads(
        (project / "artifacts/model/lineage.json").read_text())["parent"]["parent_sha256"]


def test_a_mismatched_warm_start_fails_before_training_naming_the_tensors(project):
    set_params(project, {"train": {"init_from": "artifacts/model"}, "model": {"d_model": 48, "n_heads": 2}})
    failed = sh(["python", "-m", "tasks.train"], project, check=False)
    message = " ".join(failed.stderr.split())  # the console wraps long lines
    assert failed.returncode == 1
    assert "does not fit model.* of this run" in message
    assert "blocks.0.attn.q_proj.weight (32, 32) vs (48, 48)" in message
    assert "step 1" not in failed.stdout + failed.stderr


def test_the_stage_and_eval_agree_on_the_same_text(read_only):
    project = read_only
    docs = [json.loads(line)["text"] for line in (project / "data/prepared/val.jsonl").read_text().splitlines()]
    (project / "val.txt").write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    out = sh(["ultrathink", "eval", "--model", "artifacts/model", "--text-file", "val.txt"], project).stdout
    bpb = float(out.split("bits/byte")[1].split()[0])
    stage = metrics(project)
    assert abs(bpb - stage["val_bpb"]) <= 0.005 * stage["val_bpb"], (bpb, stage["val_bpb"])
    assert f"{int(stage['val_tokens_scored']):,} tokens" in out


def test_export_takes_a_checkpoint_or_a_registered_version(read_only, tmp_path):
    """`ultrathink export --model` a training checkpoint (with the run's tokenizer, checked against the one it was
    trained with) or an MLflow URI: transformers computes what the model computes. The champion is the model dir;
    the best checkpoint holds the same weights as trained, before train.calibrate divided the logits by its
    temperature."""
    project = read_only
    import torch
    from transformers import AutoModelForCausalLM

    from ultrathink.model import UltraThink

    best = next((project / "artifacts" / "checkpoints").glob("*/best"))
    ours = UltraThink.from_pretrained(project / "artifacts" / "model")
    summary = json.loads((project / "artifacts/model/train_summary.json").read_text())
    assert not summary["averaged"]  # train.select best: the model dir holds the best checkpoint's step
    ids = torch.tensor([[1, 5, 9, 42, 7, 3]])
    with torch.no_grad():
        logits = ours(ids).logits
    for model, expected in ((str(best), logits * summary["calibration"]["temperature"]),
                            ("models:/ultrathink@champion", logits)):
        out = tmp_path / model.replace("/", "_").replace(":", "_")
        shown = sh(["ultrathink", "export", "--model", model, "--out", str(out)], project).stdout
        assert "LlamaForCausalLM" in shown, shown  # the tiny e2e model has no q/k norms (e2e_helpers.TINY)
        with torch.no_grad():
            exported = AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits
            assert (exported - expected).abs().max() <= 1e-4, model
    # The promote stage logged the same export with the version it registered (registry.promote.log_hf_export).
    import mlflow

    champion = client_for(project).get_model_version_by_alias("ultrathink", "champion")
    logged = mlflow.artifacts.download_artifacts(champion.tags["hf_export"], dst_path=str(tmp_path / "logged"))
    with torch.no_grad():
        exported = AutoModelForCausalLM.from_pretrained(logged).eval()(ids).logits
        assert (exported - logits).abs().max() <= 1e-4
    from hf_models import tokenizer

    tokenizer().save_pretrained(tmp_path / "other")  # a checkpoint read with another tokenizer than its own
    refused = sh(["ultrathink", "export", "--model", str(best), "--out", str(tmp_path / "no"), "-S",
                  f"paths.tokenizer_dir={tmp_path / 'other'}"], project, check=False)
    assert refused.returncode == 1 and "trained with tokenizer" in " ".join(refused.stderr.split()), refused.stderr
    assert not (tmp_path / "no").exists()


def test_queued_sweep_lands_in_the_project_store_and_the_best_is_champion(project):
    before = {v.version for v in client_for(project).search_model_versions("name='ultrathink'")}
    sh(["dvc", "exp", "run", "--queue", "-S", "train.lr=0.002,0.03", "-S", "train.max_steps=8",
        "-S", "train.warmup_steps=2"], project)
    sh(["dvc", "queue", "start", "-j", "2"], project)
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline:
        status = sh(["dvc", "queue", "status"], project).stdout
        if "Queued" not in status and "Running" not in status:
            break
        time.sleep(5)
    # A task that did not succeed (Failed, or still Queued/Running at the deadline) is named with its own log.
    unfinished = [row.split()[0] for row in status.splitlines() if row.split()[-1:] in (
        ["Failed"], ["Queued"], ["Running"], ["Unknown"])]
    shown = {task: sh(["dvc", "queue", "logs", task], project, check=False) for task in unfinished}
    logs = "".join(f"\n--- dvc queue logs {task}:\n{(d.stdout + d.stderr)[-3000:]}" for task, d in shown.items())
    assert status.count("Success") == 2 and not unfinished, status + logs
    client = client_for(project)
    versions = [v for v in client.search_model_versions("name='ultrathink'") if v.version not in before]
    assert len(versions) == 2
    runs = {v.version: client.get_run(v.run_id) for v in versions}
    names = {r.data.tags.get("dvc_exp_name") for r in runs.values()}
    assert None not in names and len(names) == 2
    assert all(r.data.tags.get("dvc_exp_baseline_rev") for r in runs.values())
    assert not list((project / ".dvc/tmp/exps").rglob("mlflow.db"))  # nothing written into the copies' stores
    # Both were judged on the same held-out text: the one with the lower score there is champion.
    scores = {v.version: float(v.tags["val_bpb"]) for v in versions}
    assert len({v.tags["yardstick_sha256"] for v in versions}) == 1
    champion = client.get_model_version_by_alias("ultrathink", "champion").version
    best = min(scores, key=scores.get)
    assert champion == best or float(client.get_model_version("ultrathink", champion).tags["val_bpb"]) <= scores[best]
    # dvc exp show carries each experiment's MLflow run id; applying the winner reproduces without retraining.
    shown = sh(["dvc", "exp", "show", "--csv"], project).stdout
    header, *rows = shown.splitlines()
    column = header.split(",").index("mlflow_run_id")
    run_ids = {row.split(",")[column] for row in rows}
    assert {r.info.run_id for r in runs.values()} <= run_ids
    winner = runs[best].data.tags["dvc_exp_name"]
    sh(["dvc", "exp", "apply", winner], project)
    assert ran_stages(sh(["dvc", "repro"], project).stdout) == []
    assert yaml.safe_load((project / "params.yaml").read_text())["train"]["max_steps"] == 8


def test_the_flow_retries_promote_through_a_store_that_stays_busy(project):
    """A store locked for longer than SQLite's busy timeout fails the promote stage once; Prefect retries that stage
    (it is idempotent), and the retry registers the model once."""
    set_params(project, {"registry": {"model_name": "retried"}})  # only promote is stale
    store = sqlite3.connect(project / "mlflow.db", timeout=0, isolation_level=None)
    store.execute("BEGIN EXCLUSIVE")  # another writer holding the store: every reader and writer waits, then fails
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env.pop("MLFLOW_TRACKING_URI", None)
    flow = subprocess.Popen([sys.executable, "-m", "flows.pipeline"], cwd=project, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines, released = [], False
    try:
        for line in flow.stdout:
            lines.append(line)
            if "Retry 1/2 will start" in line and not released:
                store.execute("COMMIT")  # the store frees up before the retry starts
                released = True
        flow.wait(timeout=300)
    finally:
        if not released:
            store.execute("ROLLBACK")
        store.close()
    log = "".join(lines)
    assert flow.returncode == 0 and released, log[-3000:]
    assert "promote: ran in" in log and "database is locked" in log
    assert decision(project)["promoted"] and decision(project)["model_name"] == "retried"
    assert [int(v.version) for v in client_for(project).search_model_versions("name='retried'")] == [1]
