import os
import shutil
from pathlib import Path

import pytest
from filelock import FileLock

import ultrathink  # noqa: F401  (sets the quiet/offline environment for everything the tests import)

os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")


@pytest.fixture(scope="session")
def trained_project(tmp_path_factory, worker_id) -> Path:
    """The tiny pipeline after one `dvc repro`, trained once per test run; end-to-end tests work on copies of it
    (e2e_helpers.copy_project) and never change it. Under pytest-xdist the first worker to ask trains it in the
    run's shared folder while the others wait for it (pytest-xdist's recipe), not each worker its own."""
    from e2e_helpers import train_baseline

    if worker_id == "master":
        return train_baseline(tmp_path_factory.mktemp("trained"))
    shared = tmp_path_factory.getbasetemp().parent / "trained"
    finished = shared / "finished"
    with FileLock(f"{shared}.lock"):
        if not finished.is_file():
            shutil.rmtree(shared, ignore_errors=True)  # what a worker that failed here left
            shared.mkdir()
            train_baseline(shared)
            finished.touch()
    return shared / "project"
