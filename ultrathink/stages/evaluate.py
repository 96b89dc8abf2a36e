"""evaluate: held-out loss, perplexity and bits per byte (the one yardstick of ultrathink.evaluate, on every val
document or the first evaluate.max_val_bytes of them) against the unigram baseline, the downstream tasks of
evaluate.tasks through lm-evaluation-harness (ultrathink.downstream; the built-in one is written from the val
documents first), sample generations, the loss curves as DVC plots and the report card. The metrics also go to the
model's MLflow run, whose id metrics.json carries, with lm-eval's results and the report card."""

import csv
import io
import json
import logging
import shutil
from pathlib import Path

import mlflow

from ultrathink import downstream
from ultrathink.config import Params
from ultrathink.data.packing import val_documents
from ultrathink.data.tokens import load_split, read_meta
from ultrathink.errors import StageError
from ultrathink.evaluate import (Yardstick, bits_per_byte, encode_documents, sample_generations, score_stream,
                                 unigram_cross_entropy)
from ultrathink.device import resolve_device
from ultrathink.io import atomic_write_json, atomic_write_text
from ultrathink.model import UltraThink
from ultrathink.registry.tracking import run_of_model, start_or_resume_run
from ultrathink.report_card import write_report_card
from ultrathink.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


def curve_csv(history: list[dict], key: str, tokens_per_step: int) -> str:
    """step, tokens seen and `key` at every logged step that has it."""
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["step", "tokens", key])
    writer.writerows([row["step"], row["step"] * tokens_per_step, row[key]] for row in history if key in row)
    return out.getvalue()


def project_tasks(params: Params) -> tuple[downstream.TaskSet, dict[str, str]]:
    """evaluate.tasks as a TaskSet, after writing the built-in task from the val documents when it is listed; and
    the tasks left out, with why: the built-in task when the val documents are too few or too short to make it (a
    warning: it is a default, not a task the user wrote). Task files must lie in eval_tasks/, which dvc.yaml
    tracks, so that editing one re-runs the stage."""
    cfg, p = params.evaluate, params.paths
    for spec in cfg.tasks:
        inside = Path(spec).resolve().is_relative_to(Path(downstream.TASKS_FOLDER).resolve())
        if downstream.is_task_file(spec) and not inside:
            raise StageError(f"evaluate.tasks: {spec} is not in {downstream.TASKS_FOLDER}/, the folder dvc.yaml "
                             f"tracks for the evaluate and promote stages: move it there (with its data files) so "
                             f"that editing it re-runs them")
    specs, skipped = list(cfg.tasks), {}
    shutil.rmtree(p.tasks_dir, ignore_errors=True)  # no task of an earlier run is left to look current
    Path(p.tasks_dir).mkdir(parents=True)
    if downstream.BUILTIN_TASK in specs:
        try:
            downstream.write_builtin_task(val_documents(Path(p.prepared_dir)), Path(p.tasks_dir))
        except downstream.TaskError as exc:
            log.warning("%s; it is left out of this evaluation", exc)
            specs.remove(downstream.BUILTIN_TASK)
            skipped[downstream.BUILTIN_TASK] = str(exc)
    return downstream.task_set(specs, Path(p.tasks_dir)), skipped


def run(params: Params) -> None:
    p, cfg = params.paths, params.evaluate
    model_dir, prepared = Path(p.model_dir), Path(p.prepared_dir)
    tasks, skipped = project_tasks(params)
    loaded = downstream.load_tasks(tasks)  # a task that cannot run stops the stage before any scoring
    # On the GPU when there is one: the device promote re-scores the champion on (text_eval.score_model's auto).
    model = UltraThink.from_pretrained(model_dir, device=resolve_device())
    tokenizer = load_tokenizer(p.tokenizer_dir)
    meta = read_meta(prepared)
    yardstick = Yardstick(tuple(val_documents(prepared, cfg.max_val_bytes)))
    stream = encode_documents(tokenizer, yardstick.documents)
    score = score_stream(model, stream, yardstick.bytes, len(yardstick.documents), cfg.batch_size)
    unigram = unigram_cross_entropy(load_split(prepared, "train"), stream[1:].numpy(), meta["vocab_size"])
    metrics = {"val_loss": score.loss, "val_perplexity": score.perplexity, "val_bpb": score.bits_per_byte,
               "val_tokens_scored": float(score.tokens), "val_bytes_scored": float(score.bytes),
               "val_documents_scored": float(score.documents), "unigram_loss": unigram,
               "unigram_bpb": bits_per_byte(unigram, score.tokens, score.bytes)}
    results = (downstream.run_loaded(model, tokenizer, loaded, cfg.task_limit, cfg.batch_size) if tasks.specs
               else {"results": {}})
    scores = downstream.task_scores(results)
    samples = sample_generations(model, tokenizer, cfg)
    history = json.loads((model_dir / "history.json").read_text())
    tokens_per_step = json.loads((model_dir / "train_summary.json").read_text())["plan"]["tokens_per_step"]
    train_run = json.loads(Path(p.train_run).read_text())

    atomic_write_json(p.task_results, results)
    atomic_write_json(p.samples, samples)
    atomic_write_text(p.loss_curve, curve_csv(history, "train_loss", tokens_per_step))
    atomic_write_text(p.val_curve, curve_csv(history, "val_loss", tokens_per_step))
    card = write_report_card(markdown=Path(p.report), plots_dir=Path(p.plots_dir), model_dir=model_dir,
                             metrics=metrics, tasks=scores, samples=samples, train_run=train_run,
                             data={"validate": _read_json(Path(p.validate_report)), "prepared": meta})
    with start_or_resume_run(params.registry.experiment, Path("."),
                             run_of_model(model_dir, Path(p.train_run), params.registry.experiment, Path("."))) as run:
        mlflow.log_metrics({**metrics, **downstream.flat_metrics(scores)})
        mlflow.log_dict(samples, "eval/samples.json")
        if tasks.specs:
            mlflow.log_dict(results, "eval/lm_eval.json")
            mlflow.log_artifacts(p.tasks_dir, "eval/tasks")
        for path in card:
            mlflow.log_artifact(str(path), "report" if path.suffix == ".md" else "report/plots")
    atomic_write_json(p.metrics, {**metrics, "tasks": downstream.compact_scores(scores),
                                  "tasks_sha256": tasks.sha256(cfg.task_limit), "tasks_skipped": skipped,
                                  "yardstick_sha256": yardstick.sha256, "mlflow_run_id": run.info.run_id})
    print(f"evaluate: val_loss {score.loss:.4f} (unigram {unigram:.4f}) ppl {score.perplexity:.1f} "
          f"bpb {score.bits_per_byte:.4f} over {score.tokens:,} tokens, {score.bytes:,} bytes, "
          f"{score.documents:,} documents")
    for task, metric, value, n in downstream.score_table(scores):
        print(f"  {task} {metric} {value} ({n} examples)")
    for s in samples:
        print(f"  {s['prompt']!r} → greedy {s['greedy'][:100]!r} | sampled {s['sampled'][:100]!r}")
    print(f"  report card: {p.report}")


def _read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None
