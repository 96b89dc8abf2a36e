import os
from pathlib import Path

import pytest

import ultrathink  # noqa: F401  (sets the quiet/offline environment for everything the tests import)

os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")


@pytest.fixture(scope="session")
def trained_project(tmp_path_factory) -> Path:
    """The tiny pipeline after one `dvc repro`, trained once per session; end-to-end tests work on copies of it."""
    from e2e_helpers import train_baseline

    return train_baseline(tmp_path_factory.mktemp("trained"))
