"""Running one stage: `python -m tasks.<name> [--params P] [--set K=V]...` (dvc.yaml's commands) and `ultrathink
stage <name>` both come here, to ultrathink/stages/<name>.py's `run`. Kept apart from the CLI so a stage's process
imports only what the stage itself needs: what it imports is its code in dvc.yaml and in the checkpoint fingerprint
(lineage.module_closure)."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

from ultrathink.config import Params, ParamsError, load_params
from ultrathink.errors import StageError
from ultrathink.lineage import undeclared_code

OUR_LOGGERS = ("ultrathink",)


def run_stage(name: str, params: Params, run: Callable[[Params], None] | None = None) -> int:
    """Run the stage's `run(params)` (ultrathink/stages/<name>.py's, unless given); a stage failure is one line
    naming the stage, and exit code 1."""
    log_stage_to_file(name, params)
    run = run or importlib.import_module(f"ultrathink.stages.{name}").run
    try:
        run(params)
    except StageError as exc:
        print(f"{name} failed: {exc}", file=sys.stderr)
        _record_in_rank(exc)
        return 1
    except Exception as exc:
        _record_in_rank(exc)
        raise
    return 0


def _record_in_rank(exc: Exception) -> None:
    """A rank started by a stage's launcher (launch.py) leaves its error in the error file the elastic agent named,
    where the launching stage reads it."""
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(exc)


def stage_entry(name: str, run: Callable[[Params], None]) -> None:
    """`python -m tasks.<name> [--params P] [--set K=V]...`: the stage's code checked against its deps in dvc.yaml
    (a module the stage imports that they leave out exits 2, naming it: DVC would not see it change), the params
    checked by the schema (a bad key or value exits 2, naming it), then the stage."""
    log_to_stderr()
    parser = argparse.ArgumentParser(prog=f"python -m tasks.{name}")
    parser.add_argument("--params", "-p", type=Path, default=Path("params.yaml"), help="params file")
    parser.add_argument("--set", "-S", action="append", dest="overrides", metavar="KEY=VALUE",
                        help="override a knob, e.g. -S train.lr=3e-4 (see `ultrathink params`)")
    args = parser.parse_args()
    if undeclared := undeclared_code(f"tasks.{name}"):
        for stage, files in undeclared.items():
            print(f"error: dvc.yaml's {stage} stage runs code its deps do not name, so DVC would not re-run it when "
                  f"that code changes: {', '.join(files)}; add them to the stage's deps", file=sys.stderr)
        sys.exit(2)
    try:
        params = load_params(args.params, args.overrides)
    except ParamsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    sys.exit(run_stage(name, params, run))


def log_to_stderr() -> None:
    """Our own INFO lines (resume, the plan, precision choice) on stderr; other libraries keep their own settings."""
    for name in OUR_LOGGERS:
        logger = logging.getLogger(name)
        if not logger.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)
            logger.propagate = False


def log_stage_to_file(stage: str, params: Params) -> Path:
    """Our log lines at logging.level, on stderr and appended to paths.logs_dir/<stage>.log (time and process id on
    each line, so the ranks of a torchrun stay apart). Returns the file."""
    path = Path(params.paths.logs_dir) / f"{stage}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s"))
    handler.stage_log = True
    for name in OUR_LOGGERS:
        logger = logging.getLogger(name)
        for old in [h for h in logger.handlers if getattr(h, "stage_log", False)]:  # an earlier stage's file
            logger.removeHandler(old)
            old.close()
        logger.addHandler(handler)
        logger.setLevel(params.logging.level)
    return path
