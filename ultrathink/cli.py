"""The `ultrathink` command. Its flags come from the params schema (`--set key=value`, checked by it) and its stages
from dvc.yaml; it adds no logic of its own."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from ultrathink.config import ParamsError, Params, load_params, schema_rows
from ultrathink.errors import StageError
from ultrathink.stage import log_to_stderr, run_stage

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Pretrain your own LLM as a reproducible pipeline.")
err = Console(stderr=True)

PARAMS_OPT = typer.Option(Path("params.yaml"), "--params", "-p", help="params file")
SET_OPT = typer.Option(None, "--set", "-S", help="override a knob, e.g. -S train.lr=3e-4 (see `ultrathink params`)")
DEVICE_OPT = typer.Option("auto", "--device", help="where the model runs: auto (the GPU when there is one, else the "
                          "CPU), cpu, cuda, cuda:N, ...")


def _device(requested: str):
    """The torch.device of --device; one that is no device, or that this machine lacks, exits 2 naming it."""
    from ultrathink.device import DeviceError, resolve_device

    try:
        return resolve_device(requested)
    except DeviceError as exc:
        err.print(f"[bold red]error:[/] --device: {exc}", highlight=False)
        raise typer.Exit(2) from None


def _load(params: Path, overrides: Optional[list[str]]) -> Params:
    try:
        return load_params(params, overrides)
    except ParamsError as exc:
        err.print(f"[bold red]error:[/] {exc}", highlight=False)
        raise typer.Exit(2) from None


@app.command()
def stage(name: str = typer.Argument(..., help="a stage of dvc.yaml"), params: Path = PARAMS_OPT,
          set_: Optional[list[str]] = SET_OPT) -> None:
    """Run one pipeline stage on its own."""
    from ultrathink.pipeline import stage_order

    stages = stage_order()
    if name not in stages:
        err.print(f"[bold red]error:[/] unknown stage {name!r}; stages: {', '.join(stages)}")
        raise typer.Exit(2)
    code = run_stage(name, _load(params, set_))
    if code:
        raise typer.Exit(code)


@app.command()
def run() -> None:
    """Run the whole pipeline on params.yaml as a Prefect flow; DVC skips the stages whose inputs did not change.
    (For a one-off change of a knob, use `dvc exp run -S key=value`: it records the experiment.)"""
    _load(Path("params.yaml"), [])  # fail on bad params before Prefect starts
    from flows.pipeline import pipeline

    pipeline()
    print("done: see `make ui` (MLflow UI), `dvc metrics show`, reports/promotion.json")


MODEL_HELP = ("model dir (artifacts/model, artifacts/finetuned), Hugging Face checkpoint dir, training checkpoint "
              "(artifacts/checkpoints/<config>/best, with paths.tokenizer_dir) or MLflow URI "
              "(models:/ultrathink@champion)")


def _settings(params: Path, set_: Optional[list[str]]) -> Params:
    """params.yaml (with --set) where there is one, else the defaults."""
    return _load(params, set_) if params.exists() or set_ else Params()


@app.command("eval")
def eval_model(model: str = typer.Option(..., "--model", "-m", help=MODEL_HELP),
               text_file: Optional[Path] = typer.Option(None, "--text-file", "-f", help="UTF-8 text to score"),
               tasks: Optional[str] = typer.Option(None, "--tasks", "-t", help="lm-eval tasks, comma-separated: "
                                                   "registered names, task YAML paths, heldout_continuation"),
               limit: Optional[int] = typer.Option(None, "--limit", min=1, help="at most N examples per task"),
               output: Optional[Path] = typer.Option(None, "--output", "-o", help="write lm-eval's results JSON "
                                                     "here"),
               params: Path = PARAMS_OPT, set_: Optional[list[str]] = SET_OPT, device: str = DEVICE_OPT) -> None:
    """Score a model: bits per byte of a text file (--text-file; split into documents by data.txt_unit, scored as
    the evaluate stage scores), and/or downstream tasks through lm-evaluation-harness (--tasks; a registered model
    runs under its own code)."""
    from ultrathink import downstream
    from ultrathink.io import atomic_write_json
    from ultrathink.registry.models import evaluate_text_file, resolve_model_files

    if text_file is None and not tasks:
        err.print("[bold red]error:[/] give --text-file FILE, --tasks T1,T2, or both", highlight=False)
        raise typer.Exit(2)
    settings = _settings(params, set_)
    target = _device(device)
    try:
        if text_file is not None:
            score = evaluate_text_file(model, text_file, settings.data.txt_unit, device=target,
                                       tokenizer_dir=Path(settings.paths.tokenizer_dir))
            print(f"loss {score.loss:.4f} nats/token  bits/byte {score.bits_per_byte:.4f}  perplexity "
                  f"{score.perplexity:.2f}  ({score.tokens:,} tokens, {score.bytes:,} bytes, {score.documents:,} "
                  f"documents)")
        if tasks:
            task_set = downstream.task_set([t.strip() for t in tasks.split(",") if t.strip()],
                                           Path(settings.paths.tasks_dir))
            files = resolve_model_files(model, Path("."), Path(settings.paths.tokenizer_dir))
            results = downstream.evaluate_model(files, task_set, limit, settings.evaluate.batch_size, target)
            if output is not None:
                atomic_write_json(output, results)
            table = Table("task", "metric", "value", "examples", title=f"{model}" + (f" (limit {limit})" if limit
                                                                                     else ""))
            for row in downstream.score_table(downstream.task_scores(results)):
                table.add_row(*row)
            Console(width=160).print(table)
    except StageError as exc:
        err.print(f"[bold red]eval failed:[/] {exc}", highlight=False)
        raise typer.Exit(1) from None


MODEL_REF_OPT = typer.Option(..., "--model", "-m", help=MODEL_HELP)
MAX_NEW_OPT = typer.Option(None, help="default: evaluate.max_new_tokens")
TEMPERATURE_OPT = typer.Option(None, help="0 is greedy; default: evaluate.temperature")
TOP_K_OPT = typer.Option(None, help="default: evaluate.top_k")
TOP_P_OPT = typer.Option(None, help="default: evaluate.top_p")
SEED_OPT = typer.Option(None, help="default: evaluate.seed")


def _sampling(params: Path, set_: Optional[list[str]], flags: dict):
    """evaluate.* with the flags that were given over it, checked by the schema (a bad value exits 2)."""
    from pydantic import ValidationError

    from ultrathink.config import EvaluateConfig

    settings = _settings(params, set_)
    try:
        return EvaluateConfig.model_validate({**settings.evaluate.model_dump(),
                                              **{k: v for k, v in flags.items() if v is not None}})
    except ValidationError as exc:
        problems = "; ".join(f"--{'-'.join(map(str, e['loc'])).replace('_', '-')}: {e['msg']}" for e in exc.errors())
        err.print(f"[bold red]error:[/] {problems}", highlight=False)
        raise typer.Exit(2) from None


def _load_model(ref: str, command: str, device, settings: Params):
    """(model, tokenizer) named by a directory or an MLflow URI, the model on `device`; a missing or unreadable
    model exits 1 saying what was looked for."""
    from ultrathink.model import UltraThink
    from ultrathink.registry.models import resolve_model
    from ultrathink.tokenizer import load_tokenizer

    try:
        model_dir, tokenizer_dir = resolve_model(ref, tokenizer_dir=Path(settings.paths.tokenizer_dir))
        return UltraThink.from_pretrained(model_dir, device=device), load_tokenizer(tokenizer_dir)
    except StageError as exc:
        err.print(f"[bold red]{command} failed:[/] {exc}", highlight=False)
        raise typer.Exit(1) from None


@app.command()
def generate(model: str = MODEL_REF_OPT,
             prompt: str = typer.Option(..., "--prompt", help="text to continue (cropped to its last tokens when "
                                        "longer than the context)"),
             max_new_tokens: Optional[int] = MAX_NEW_OPT, temperature: Optional[float] = TEMPERATURE_OPT,
             top_k: Optional[int] = TOP_K_OPT, top_p: Optional[float] = TOP_P_OPT, seed: Optional[int] = SEED_OPT,
             params: Path = PARAMS_OPT, set_: Optional[list[str]] = SET_OPT, device: str = DEVICE_OPT) -> None:
    """Continue a prompt with a model, printing the text as the tokens come. Unset flags take the evaluate.*
    params, so `generate` samples as the evaluate stage and the registered model do."""
    from ultrathink.model.generate import stream_text

    cfg = _sampling(params, set_, {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_k": top_k,
                                   "top_p": top_p, "seed": seed})
    target = _device(device)
    loaded, tokenizer = _load_model(model, "generate", target, _settings(params, set_))
    for piece in stream_text(loaded, tokenizer, prompt, cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.seed,
                             cfg.top_p, target):
        print(piece, end="", flush=True)
    print()


@app.command()
def chat(model: str = MODEL_REF_OPT,
         message: Optional[str] = typer.Option(None, "--message", help="answer this one message and exit (default: "
                                               "read messages from the terminal, one per line)"),
         max_new_tokens: Optional[int] = MAX_NEW_OPT, temperature: Optional[float] = TEMPERATURE_OPT,
         top_k: Optional[int] = TOP_K_OPT, top_p: Optional[float] = TOP_P_OPT, seed: Optional[int] = SEED_OPT,
         params: Path = PARAMS_OPT, set_: Optional[list[str]] = SET_OPT, device: str = DEVICE_OPT) -> None:
    """Talk to a fine-tuned model: each line is a user message, the answer streams back, and the conversation so
    far is the context (cropped to its last tokens when longer). `/reset` starts over; an empty line or end of
    input ends. The chat template comes from the model's tokenizer (stage finetune)."""
    from ultrathink.model.chat import NOT_A_CHAT_MODEL, assistant, is_chat_tokenizer, stream_reply, user

    cfg = _sampling(params, set_, {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_k": top_k,
                                   "top_p": top_p, "seed": seed})
    target = _device(device)
    loaded, tokenizer = _load_model(model, "chat", target, _settings(params, set_))
    if not is_chat_tokenizer(tokenizer):
        err.print(f"[bold red]chat failed:[/] {model}: {NOT_A_CHAT_MODEL}", highlight=False)
        raise typer.Exit(1)
    history: list[dict] = []
    lines = [message] if message is not None else _typed_lines()
    for line in lines:
        if line.strip() == "/reset":
            history = []
            continue
        history.append(user(line))
        answer = ""
        for piece in stream_reply(loaded, tokenizer, history, cfg.max_new_tokens, cfg.temperature, cfg.top_k,
                                  cfg.seed, cfg.top_p, target):
            print(piece, end="", flush=True)
            answer += piece
        print()
        history.append(assistant(answer))


@app.command()
def export(model: str = MODEL_REF_OPT,
           out: Path = typer.Option(..., "--out", "-o", help="directory to write (replaced when it exists)"),
           params: Path = PARAMS_OPT, set_: Optional[list[str]] = SET_OPT) -> None:
    """Write a model as a Hugging Face checkpoint (Llama, Qwen2 or Mixtral, whichever computes what it computes)
    with its tokenizer and chat template, for AutoModelForCausalLM and AutoTokenizer."""
    from ultrathink.model.export import ExportError, export_hf
    from ultrathink.registry.models import resolve_model

    try:
        model_dir, tokenizer_dir = resolve_model(model, tokenizer_dir=Path(_settings(params, set_).paths.tokenizer_dir))
        written = export_hf(model_dir, tokenizer_dir, out)
    except (StageError, ExportError) as exc:
        err.print(f"[bold red]export failed:[/] {exc}", highlight=False)
        raise typer.Exit(1) from None
    config = json.loads((written / "config.json").read_text())
    print(f"export: {model} → {written} ({', '.join(config.get('architectures') or [])})")


def _typed_lines():
    """Lines from the terminal (with a prompt) or a pipe, until an empty line or end of input."""
    interactive = sys.stdin.isatty()
    while True:
        try:
            line = input("you> " if interactive else "")
        except EOFError:
            return
        if not line.strip():
            return
        yield line


registry_app = typer.Typer(no_args_is_help=True, help="The registered models: list, promote, roll back.")
app.add_typer(registry_app, name="registry")
MODEL_NAME_OPT = typer.Option(None, "--name", help="registered model (default: registry.model_name of params.yaml)")
REASON_OPT = typer.Option(..., "--reason", "-r", help="why: recorded on the version as a tag")


def _registry(name: Optional[str]):
    """(MlflowClient on the project's store, model name)."""
    from mlflow.tracking import MlflowClient

    from ultrathink.registry.tracking import use_tracking

    params = _load(Path("params.yaml"), []) if Path("params.yaml").exists() else Params()
    use_tracking(Path("."))
    return MlflowClient(), name or params.registry.model_name


@registry_app.command("list")
def registry_list(name: Optional[str] = MODEL_NAME_OPT) -> None:
    """Every version: aliases, val_bpb and the text it was measured on, downstream task scores, lineage, champion
    moves."""
    from ultrathink.registry.champion import champion_history, describe_versions

    client, model = _registry(name)
    rows = describe_versions(client, model)
    if not rows:
        err.print(f"no versions of {model!r} in {client.tracking_uri}")
        raise typer.Exit(1)
    table = Table(*rows[0], title=f"{model} ({client.tracking_uri})")
    for row in rows:
        table.add_row(*row.values())
    Console(width=200).print(table)
    print(f"champion history (oldest first): {champion_history(client, model) or 'none'}")


def _task_guard(model: str, version: int):
    """registry.task_guard of params.yaml, with VERSION scored on the project's tasks under its own code."""
    from ultrathink import downstream
    from ultrathink.registry.promote import version_evidence

    settings = _settings(Path("params.yaml"), None)
    guard, cfg = settings.registry.task_guard, settings.evaluate
    if not guard:
        return None
    tasks = downstream.task_set(cfg.tasks, Path(settings.paths.tasks_dir))
    return version_evidence(model, version, tasks, cfg.task_limit, cfg.batch_size, dict(guard)).guard_for(model)


@registry_app.command("promote")
def registry_promote(version: int = typer.Argument(..., help="the version to make champion"),
                     force: bool = typer.Option(False, "--force", help="skip the guards (the yardstick comparison, "
                                                "registry.task_guard)"),
                     reason: Optional[str] = typer.Option(None, "--reason", "-r", help="why (recorded as a tag)"),
                     name: Optional[str] = MODEL_NAME_OPT) -> None:
    """Make VERSION champion if it beats the champion on VERSION's own yardstick text and, with registry.task_guard,
    is not worse than it on a guarded task of the project's (or always, with --force)."""
    from mlflow.exceptions import MlflowException

    from ultrathink.registry.champion import actor, decide_and_move, version_yardstick

    client, model = _registry(name)
    try:
        target = client.get_model_version(model, str(version))
        if force:
            decision = decide_and_move(client, model, version, math.nan, None, Path("."), actor(),
                                       force_reason=reason or "no reason given")
        else:
            yardstick = version_yardstick(target)
            decision = decide_and_move(client, model, version, float(target.tags["val_bpb"]), yardstick, Path("."),
                                       actor(), guard=_task_guard(model, version))
    except (StageError, KeyError, MlflowException) as exc:
        err.print(f"[bold red]registry promote failed:[/] {getattr(exc, 'message', exc)}", highlight=False)
        raise typer.Exit(1) from None
    print(f"{model} v{version}: {'champion' if decision.promoted else 'not promoted'} — {decision.reason}")
    if not decision.promoted:
        raise typer.Exit(1)


@registry_app.command("rollback")
def registry_rollback(reason: str = REASON_OPT, name: Optional[str] = MODEL_NAME_OPT) -> None:
    """Champion back to the previous champion (walks champion_history back one step per call)."""
    from ultrathink.registry.champion import RegistryError, actor, rollback

    client, model = _registry(name)
    try:
        old, new = rollback(client, model, Path("."), actor(), reason)
    except RegistryError as exc:
        err.print(f"[bold red]registry rollback failed:[/] {exc}", highlight=False)
        raise typer.Exit(1) from None
    print(f"{model}: champion v{old} → v{new}")


@app.command("params")
def list_params() -> None:
    """Every knob of params.yaml with its type, default and meaning."""
    table = Table("key", "type", "default", "description")
    for row in schema_rows():
        table.add_row(*row)
    Console().print(table)


def main() -> None:
    log_to_stderr()
    app()
