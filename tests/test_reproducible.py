"""Same commit, same machine class, same bytes: the train stage run again in a new process — beside a process that
keeps a core busy — with the defaults that used to follow timings (train.attention and train.precision auto)
trains bit-identical weights, writes a bit-identical model directory, and DVC finds the
pipeline up to date. Deleting the recorded plan makes the next run measure again."""

import hashlib
import json
import re
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from e2e_helpers import TINY, copy_project, make_project, sh
from ultrathink.config import load_params
from ultrathink.data.tokens import load_split, read_meta
from ultrathink.model.kernels import candidates
from ultrathink.stages.pretrain import weights_fingerprint
from ultrathink.train.engine import autocast_dtype
from ultrathink.train.plan import Plan, configuration_key

pytestmark = [pytest.mark.slow, pytest.mark.spawns]

MODEL_FILES = ("model.safetensors", "config.json", "history.json", "train_summary.json", "lineage.json")


def digests(project: Path) -> dict[str, str]:
    model = project / "artifacts/model"
    return {name: hashlib.sha256((model / name).read_bytes()).hexdigest() for name in MODEL_FILES}


@contextmanager
def busy_core():
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()


def test_a_second_run_beside_a_busy_core_trains_the_same_bytes_and_dvc_is_up_to_date(trained_project, tmp_path):
    project = copy_project(trained_project, tmp_path)
    params = yaml.safe_load((project / "params.yaml").read_text())
    assert params["train"]["attention"] == params["train"]["precision"] == "auto"
    first, first_run = digests(project), json.loads((project / "reports/train_run.json").read_text())
    for gone in ("artifacts/model", "artifacts/checkpoints"):
        sh(["rm", "-rf", gone], project)

    with busy_core():
        again = sh([sys.executable, "-m", "tasks.train"], project)
    assert "(recorded for cpu/" in again.stderr  # the plan was read back: nothing was measured
    assert "attention auto →" not in again.stderr and "precision auto →" not in again.stderr
    assert digests(project) == first
    second_run = json.loads((project / "reports/train_run.json").read_text())
    assert second_run["run_id"] != first_run["run_id"] and second_run["model_sha256"] == first_run["model_sha256"]
    status = sh(["dvc", "status", "train"], project)
    assert "up to date" in status.stdout, status.stdout
    # The model is the same bytes, but it was trained again: evaluate logs into the new run, promote registers it.
    status = sh(["dvc", "status", "evaluate", "promote"], project)
    changed = [line.split() for line in status.stdout.splitlines() if "reports/train_run.json" in line]
    assert changed == [["modified:", "reports/train_run.json"]] * 2, status.stdout


def test_deleting_the_recorded_plan_measures_again(trained_project, tmp_path):
    project = copy_project(trained_project, tmp_path)
    # The class the session's training ran on (the book also holds the shipped reference run's).
    machine = re.search(r"\(measured on (.+?)\)\n", (project / "reports/logs/train.log").read_text()).group(1)
    entry = json.loads((project / "plans/train.json").read_text())[machine]
    (project / "plans/train.json").unlink()
    again = sh([sys.executable, "-m", "tasks.train", "-S", "train.resume=false"], project)
    assert f"(measured on {machine})" in again.stderr and "precision auto →" in again.stderr
    remade = json.loads((project / "plans/train.json").read_text())
    (key,) = remade[machine]["plans"]  # this configuration's plan again (the book also had the shipped default's)
    assert key in entry["plans"]
    assert remade[machine]["matmul_gflops"].keys() == {"fp32", "bf16"}
    # Attention is timed again where this machine gives it a choice: under bf16, not in fp32 with attention dropout
    # (an AVX2-only CPU), where torch's kernel is the only candidate.
    precision = remade[machine]["plans"][key]["precision"]
    options = candidates("auto", "cpu", autocast_dtype(precision, "cpu"), TINY["model"]["dropout"])
    assert ("attention auto →" in again.stderr) == (len(options) > 1), (precision, options)
    assert bool(remade[machine]["plans"][key]["attention_ms"]) == (len(options) > 1)


def test_python_bytecode_beside_the_code_leaves_the_pipeline_up_to_date(trained_project, tmp_path):
    """Any import writes __pycache__/ into the code directories stages depend on (ultrathink/train, ...), with
    this machine's source mtimes inside: DVC must not hash them, or a dvc.lock from elsewhere never matches."""
    project = copy_project(trained_project, tmp_path)
    sh([sys.executable, "-m", "compileall", "-q", "ultrathink", "tasks"], project)
    assert list((project / "ultrathink/train/__pycache__").glob("*.pyc"))
    status = sh(["dvc", "status", "train", "finetune"], project)
    assert "up to date" in status.stdout, status.stdout


def test_the_committed_lock_and_plan_book_are_what_a_fresh_clone_rebuilds_and_reads(tmp_path):
    """A fresh clone with the shipped params rebuilds the locked hashes of the data stages (on any machine: they do
    not depend on its class); the committed plan book holds the shipped configuration's plan for the class the
    lock's train outputs were made on (reports/train_run.json), so a clone of that class reads it back; and those
    outputs were made by this commit's params, data, training code and plan (the weights' fingerprint), so it
    trains the locked bytes. A change to any of them committed without a reference run (a fresh clone's `make run`,
    its dvc.lock, plan book and reports committed) fails here: from 2026-11-27 to 2026-12-03 the lock's train
    outputs were an older code's, and from 2026-11-29 the book held no plan for the shipped configuration. So does
    a change to a file the train stage's deps name but its fingerprint does not: on 2026-12-04, when the deps named
    ultrathink/train as a directory, an edit of sizing_evidence.py (which nothing trained imports) left `dvc repro`
    retraining a fresh clone (the deps are now exactly the closure: test_lineage)."""
    project = make_project(tmp_path, tiny=False)
    sh(["dvc", "repro", "prepare"], project)
    status = sh(["dvc", "status", "validate", "tokenizer", "prepare"], project)
    assert "up to date" in status.stdout, status.stdout
    train = sh(["dvc", "status", "train"], project).stdout  # its outputs are not in this clone's cache: only deps
    assert "modified:" not in train, train
    params, prepared = load_params(project / "params.yaml"), project / "data/prepared"
    key = configuration_key(params.model, params.train, read_meta(prepared)["vocab_size"],
                            len(load_split(prepared, "train")), len(load_split(prepared, "val")), 1)
    reference = json.loads((project / "reports/train_run.json").read_text())
    book = project / "plans/train.json"
    plans = json.loads(book.read_text())[reference["machine"]]["plans"]
    assert key in plans, f"no plan for the shipped configuration ({key})"
    made_by = weights_fingerprint(params, prepared, Plan.from_dict(plans[key]), parent=None)
    assert made_by.id == reference["fingerprint"], ("the locked train outputs were made by other params, data, "
                                                     "training code or plan: make a reference run (a fresh clone's "
                                                     "`make run`) and commit its dvc.lock, plans and reports")
    locked = yaml.safe_load((project / "dvc.lock").read_text())["stages"]["train"]
    assert next(out["md5"] for out in locked["outs"] if out["path"] == "plans/train.json") == \
        hashlib.md5(book.read_bytes()).hexdigest()
