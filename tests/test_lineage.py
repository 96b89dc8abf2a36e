"""The code a stage runs is derived from its imports (lineage.module_closure), not kept by hand: dvc.yaml lists
exactly that code for every stage, and the checkpoint fingerprint's code hash moves with exactly that code."""

import shutil
import sys
from pathlib import Path

import pytest
import yaml

from e2e_helpers import sh
from ultrathink.finetune.sft import FINETUNE_CODE
from ultrathink.lineage import PROJECT_ROOT, TRAINING_CODE, code_hash, module_closure, undeclared_code

STAGES = yaml.safe_load((PROJECT_ROOT / "dvc.yaml").read_text())["stages"]


# What `python -m tasks.<stage>` runs besides the stage module's own closure: the entry point and the stage runner
# (argument parsing, log files, exit codes), which compute nothing.
RUNNER = {stage: {f"tasks/{stage}.py", "tasks/__init__.py", "ultrathink/stage.py"} for stage in ("train", "finetune")}


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_dvc_yaml_lists_exactly_the_code_the_stage_imports(stage):
    """Every module the stage runs, so editing it re-runs the stage; and no other file of the project's code, so
    editing one the stage never imports (ultrathink/train/sizing_evidence.py, the record behind the sizing
    constants) does not — a directory dep would name both."""
    entry = STAGES[stage]["cmd"].removeprefix("python -m ").split()[0]
    assert stage not in undeclared_code(entry), undeclared_code(entry)  # what the stage's command itself checks
    deps = {d if isinstance(d, str) else next(iter(d)) for d in STAGES[stage]["deps"]}
    code = {dep for dep in deps if dep.startswith(("ultrathink/", "tasks/"))}
    extra = code - {str(p) for p in module_closure(entry)}  # a directory too: it names files the stage never runs
    assert not extra, f"dvc.yaml's {stage} stage names code {entry} does not import: {sorted(extra)}"


def test_the_train_closure_has_the_token_reader_and_the_variants_and_not_the_other_stages():
    train = {str(p) for p in module_closure("tasks.train")}
    # The reader that supplies every training batch, the variants a config enables, the stage's own module.
    assert {"ultrathink/data/tokens.py", "ultrathink/model/moe.py", "ultrathink/model/dre.py",
            "ultrathink/model/csrc/cpu_kernels.cpp", "ultrathink/train/trainer.py", "ultrathink/train/plan.py",
            "ultrathink/stages/train.py", "tasks/train.py"} <= train
    # A stage does not run the CLI, another stage's code, the corpus gate or the token writer.
    assert not {"ultrathink/cli.py", "tasks/validate.py", "ultrathink/stages/validate.py",
                "ultrathink/data/validation.py", "ultrathink/data/packing.py",
                "ultrathink/registry/champion.py"} & train
    # The checkpoint fingerprint's code is the stage module's closure: tasks/train.py's less the entry point and
    # the stage runner (argument parsing, log files, exit codes), which compute nothing.
    assert {str(p) for p in module_closure(TRAINING_CODE)} == train - RUNNER["train"]


@pytest.mark.parametrize("stage, code", [("train", TRAINING_CODE), ("finetune", FINETUNE_CODE)])
def test_the_fingerprinted_code_is_what_the_stage_command_runs(stage, code):
    entry = STAGES[stage]["cmd"].removeprefix("python -m ").split()[0]
    assert {str(p) for p in module_closure(code)} == {str(p) for p in module_closure(entry)} - RUNNER[stage]


@pytest.fixture
def project_copy(tmp_path) -> Path:
    for package in ("ultrathink", "tasks"):
        shutil.copytree(PROJECT_ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def test_the_code_hash_moves_with_code_the_stage_imports_and_only_with_it(project_copy):
    before = code_hash("tasks.train", project_copy)
    with (project_copy / "ultrathink/data/validation.py").open("a") as f:  # the corpus gate: not train's code
        f.write("\n# an edit\n")
    assert code_hash("tasks.train", project_copy) == before
    with (project_copy / "ultrathink/data/tokens.py").open("a") as f:  # the token reader: train's code
        f.write("\n# an edit\n")
    after_python = code_hash("tasks.train", project_copy)
    assert after_python != before
    with (project_copy / "ultrathink/model/csrc/cpu_kernels.cpp").open("a") as f:  # C++ the model builds and runs
        f.write("\n// an edit\n")
    after_native = code_hash("tasks.train", project_copy)
    assert after_native != after_python
    with (project_copy / "ultrathink/data/assets/reference.json.xz").open("ab") as f:  # the corpus a module ships
        f.write(b"\0")
    assert code_hash("tasks.train", project_copy) != after_native


def test_the_closure_follows_function_level_and_relative_imports(project_copy):
    (project_copy / "ultrathink/extra").mkdir()
    (project_copy / "ultrathink/extra/__init__.py").write_text("")
    (project_copy / "ultrathink/extra/deep.py").write_text("X = 1\n")
    (project_copy / "ultrathink/extra/side.py").write_text("def f():\n    from . import deep\n    return deep.X\n")
    with (project_copy / "tasks/train.py").open("a") as f:
        f.write("\n\ndef later():\n    from ultrathink.extra import side\n    return side.f()\n")
    closure = {str(p) for p in module_closure("tasks.train", project_copy)}
    assert {"ultrathink/extra/__init__.py", "ultrathink/extra/side.py", "ultrathink/extra/deep.py"} <= closure
    with pytest.raises(ModuleNotFoundError, match="tasks.nothing"):
        module_closure("tasks.nothing", project_copy)


def add_module_to_the_model(project: Path) -> None:
    """A user's new module, imported by the model every stage that loads one runs."""
    (project / "ultrathink/model/extra.py").write_text("SCALE = 1.0\n")
    with (project / "ultrathink/model/model.py").open("a") as f:
        f.write("\nfrom ultrathink.model.extra import SCALE  # noqa: E402,F401\n")


def test_a_module_dvc_yaml_does_not_name_is_reported_for_each_stage_that_runs_it(project_copy):
    assert undeclared_code("tasks.train", project_copy) == {}  # no dvc.yaml: nothing to check against
    shutil.copy(PROJECT_ROOT / "dvc.yaml", project_copy / "dvc.yaml")
    assert undeclared_code("tasks.train", project_copy) == undeclared_code("tasks.validate", project_copy) == {}
    add_module_to_the_model(project_copy)
    assert undeclared_code("tasks.train", project_copy) == {"train": ["ultrathink/model/extra.py"]}
    assert undeclared_code("tasks.evaluate", project_copy) == {"evaluate": ["ultrathink/model/extra.py"]}
    assert undeclared_code("tasks.validate", project_copy) == {}  # the corpus gate loads no model
    dvc_yaml = project_copy / "dvc.yaml"
    stages = yaml.safe_load(dvc_yaml.read_text())
    stages["stages"]["train"]["deps"].append("ultrathink/model")  # a folder above the module names it too
    dvc_yaml.write_text(yaml.safe_dump(stages, sort_keys=False))
    assert undeclared_code("tasks.train", project_copy) == {}


def test_a_stage_whose_deps_leave_out_code_it_runs_stops_before_it_reads_or_writes_anything(project_copy):
    """What dvc repro runs refuses to train when dvc.yaml would not re-run it on an edit of the module: exit 2, the
    module and the fix named, no log, plan or model written."""
    for name in ("dvc.yaml", "params.yaml"):
        shutil.copy(PROJECT_ROOT / name, project_copy / name)
    add_module_to_the_model(project_copy)
    done = sh([sys.executable, "-m", "tasks.train"], project_copy, check=False)
    assert done.returncode == 2, done.stderr
    assert ("error: dvc.yaml's train stage runs code its deps do not name, so DVC would not re-run it when that "
            "code changes: ultrathink/model/extra.py; add them to the stage's deps") in done.stderr
    assert sorted(p.name for p in project_copy.iterdir()) == ["dvc.yaml", "params.yaml", "tasks", "ultrathink"]
