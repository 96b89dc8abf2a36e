"""The code a stage runs is derived from its imports (lineage.module_closure), not kept by hand: dvc.yaml lists
exactly that code for every stage, and the checkpoint fingerprint's code hash moves with exactly that code."""

import shutil
from pathlib import Path

import pytest
import yaml

from ultrathink.finetune.sft import FINETUNE_CODE
from ultrathink.lineage import PROJECT_ROOT, TRAINING_CODE, code_hash, module_closure

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
    deps = {d if isinstance(d, str) else next(iter(d)) for d in STAGES[stage]["deps"]}
    code = {dep for dep in deps if dep.startswith(("ultrathink/", "tasks/"))}
    closure = {str(p) for p in module_closure(entry)}
    assert not closure - code, f"dvc.yaml's {stage} stage runs {entry}, which imports these; add them to its deps: " \
                               f"{sorted(closure - code)}"
    assert not code - closure, f"dvc.yaml's {stage} stage names code {entry} does not import: {sorted(code - closure)}"


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
