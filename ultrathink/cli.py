"""The `ultrathink` command. Its flags come from the params schema (`--set key=value`, checked by it) and its stages
from dvc.yaml; it adds no logic of its own."""

from __future__ import annotations

import importlib
import logging
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from ultrathink.config import ParamsError, Params, load_params, schema_rows
from ultrathink.errors import StageError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Pretrain your own LLM as a reproducible pipeline.")
err = Console(stderr=True)

PARAMS_OPT = typer.Option(Path("params.yaml"), "--params", "-p", help="params file")
SET_OPT = typer.Option(None, "--set", "-S", help="override a knob, e.g. -S train.lr=3e-4 (see `ultrathink params`)")


def _load(params: Path, overrides: Optional[list[str]]) -> Params:
    try:
        return load_params(params, overrides)
    except ParamsError as exc:
        err.print(f"[bold red]error:[/] {exc}", highlight=False)
        raise typer.Exit(2) from None


def run_stage(name: str, params: Params) -> None:
    """Run one stage's `run(params)` from tasks/<name>.py; a stage failure exits non-zero with its message."""
    module = importlib.import_module(f"tasks.{name}")
    try:
        module.run(params)
    except StageError as exc:
        err.print(f"[bold red]{name} failed:[/] {exc}", highlight=False)
        raise typer.Exit(1) from None


@app.command()
def stage(name: str = typer.Argument(..., help="a stage of dvc.yaml"), params: Path = PARAMS_OPT,
          set_: Optional[list[str]] = SET_OPT) -> None:
    """Run one pipeline stage on its own."""
    from ultrathink.pipeline import stage_order

    stages = stage_order()
    if name not in stages:
        err.print(f"[bold red]error:[/] unknown stage {name!r}; stages: {', '.join(stages)}")
        raise typer.Exit(2)
    run_stage(name, _load(params, set_))


@app.command()
def run() -> None:
    """Run the whole pipeline on params.yaml as a Prefect flow; DVC skips the stages whose inputs did not change.
    (For a one-off change of a knob, use `dvc exp run -S key=value`: it records the experiment.)"""
    _load(Path("params.yaml"), [])  # fail on bad params before Prefect starts
    from flows.pipeline import pipeline

    pipeline()
    print("done: see `make ui` (MLflow UI), `dvc metrics show`, reports/promotion.json")


@app.command("eval")
def eval_text(model: str = typer.Option(..., "--model", "-m", help="model dir (artifacts/model) or MLflow URI "
                                        "(models:/ultrathink@champion)"),
              text_file: Path = typer.Option(..., "--text-file", "-f", help="UTF-8 text to score")) -> None:
    """Loss and bits per byte of a text file under a model and its own tokenizer."""
    from ultrathink.text_eval import evaluate_text_file

    try:
        score = evaluate_text_file(model, text_file)
    except StageError as exc:
        err.print(f"[bold red]eval failed:[/] {exc}", highlight=False)
        raise typer.Exit(1) from None
    print(f"loss {score.loss:.4f} nats/token  bits/byte {score.bits_per_byte:.4f}  perplexity {score.perplexity:.2f}"
          f"  ({score.tokens:,} tokens, {score.bytes:,} bytes)")


@app.command("params")
def list_params() -> None:
    """Every knob of params.yaml with its type, default and meaning."""
    table = Table("key", "type", "default", "description")
    for row in schema_rows():
        table.add_row(*row)
    Console().print(table)


def _log_to_stderr() -> None:
    """Our own INFO lines (resume, precision choice) on stderr; other libraries keep their own settings."""
    logger = logging.getLogger("ultrathink")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def stage_entry(name: str) -> None:
    """`python -m tasks.<name> [--params P] [--set K=V]...` is `ultrathink stage <name> ...`."""
    _log_to_stderr()
    app(["stage", name, *sys.argv[1:]], prog_name=f"python -m tasks.{name}")


def main() -> None:
    _log_to_stderr()
    app()
