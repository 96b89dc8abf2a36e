"""A multi-process run's workers end through one door, distributed.leave_at_once (see its docstring for why): once
every rank has finished, what the worker printed and logged is kept and the exit code is 0, even where the
interpreter's teardown would abort the process, as DeepSpeed's and the process groups' native destructors
sometimes did."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.spawns

WORKER = """
import atexit, logging, os, sys
from ultrathink.train.distributed import leave_at_once

log = logging.getLogger("ultrathink.worker")
log.addHandler(logging.FileHandler(sys.argv[1]))
log.warning("rank 1: outputs complete")
print("rank 1 done", end="")  # no newline: held in stdout's buffer until someone flushes it
atexit.register(os.abort)  # a teardown that aborts, as the native destructors did
{ending}
"""


def worker(tmp_path, ending: str) -> subprocess.CompletedProcess:
    log_file = tmp_path / "worker.log"
    return subprocess.run([sys.executable, "-c", WORKER.format(ending=ending), str(log_file)],
                          capture_output=True, text=True, timeout=120)


def test_a_worker_leaves_with_its_output_and_exit_code_0(tmp_path):
    done = worker(tmp_path, "leave_at_once()")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "rank 1 done"
    assert (tmp_path / "worker.log").read_text() == "rank 1: outputs complete\n"


def test_without_it_the_same_teardown_fails_the_process(tmp_path):
    """The hazard leave_at_once removes: a normal exit runs the aborting teardown."""
    done = worker(tmp_path, "sys.exit(0)")
    assert done.returncode != 0
