"""promote: log the model to MLflow and register a new version (alias `challenger`, lineage tags, the yardstick text,
its downstream task scores, its report card), score it and the current champion on that same text (the val
documents, as the evaluate stage scored them), and move `champion` to it only when it is better — and, with
registry.task_guard, not worse on a guarded task than the champion scored on the same task data; the decision, the
yardstick, both scores and the guard's checks are written as JSON."""

import json
import shutil
import tempfile
from pathlib import Path

from ultrathink import downstream
from ultrathink.config import Params
from ultrathink.data.packing import VAL_TEXT_FILE, val_documents
from ultrathink.evaluate import Yardstick
from ultrathink.io import atomic_write_json
from ultrathink.lineage import LINEAGE_FILE, lineage_tags
from ultrathink.registry.promote import REPORT_ARTIFACT, TaskEvidence, promote
from ultrathink.registry.tracking import run_of_model


def model_lineage(model_dir: Path) -> dict[str, str]:
    """Tags from the train stage's lineage.json: the configuration's fingerprint and the warm start's parent."""
    path = model_dir / LINEAGE_FILE
    if not path.is_file():
        return {}
    lineage = json.loads(path.read_text())
    return {"fingerprint": lineage["fingerprint"], **(lineage.get("parent") or {})}


def task_evidence(params: Params, metrics: dict) -> TaskEvidence:
    """The model's task scores from the evaluate stage (lm-eval's results file), which ran these very tasks on this
    very task data (metrics.json's tasks_sha256 says so; otherwise the stage is out of date: re-run it)."""
    p, cfg = params.paths, params.evaluate
    skipped = metrics.get("tasks_skipped") or {}  # the built-in task, when the val text could not make it
    tasks = downstream.task_set([t for t in cfg.tasks if t not in skipped], Path(p.tasks_dir))
    if metrics.get("tasks_sha256") != tasks.sha256(cfg.task_limit):
        raise downstream.TaskError(f"{p.metrics} was not measured on today's evaluate.tasks and their data "
                                   f"(tasks_sha256 differs): re-run the evaluate stage (dvc repro)")
    scores = downstream.task_scores(json.loads(Path(p.task_results).read_text()))
    return TaskEvidence(scores, tasks, cfg.task_limit, cfg.batch_size, dict(params.registry.task_guard))


def report_folder(params: Params, into: Path) -> Path:
    """A folder `report` in `into` holding the report card and its plots, laid out as its links expect."""
    markdown, plots = Path(params.paths.report), Path(params.paths.plots_dir)
    folder = into / REPORT_ARTIFACT
    folder.mkdir()
    shutil.copy2(markdown, folder / markdown.name)
    shutil.copytree(plots, folder / plots.resolve().relative_to(markdown.parent.resolve()))
    return folder


def run(params: Params) -> None:
    p = params.paths
    model_dir = Path(p.model_dir)
    metrics = json.loads(Path(p.metrics).read_text())
    yardstick = Yardstick(tuple(val_documents(Path(p.prepared_dir), params.evaluate.max_val_bytes)))
    measured = metrics.get("val_bpb") if metrics.get("yardstick_sha256") == yardstick.sha256 else None
    evidence = task_evidence(params, metrics)
    with tempfile.TemporaryDirectory(prefix="ultrathink-report-") as tmp:
        decision = promote(model_dir, Path(p.tokenizer_dir), yardstick, params.registry, params.evaluate,
                           {**lineage_tags(params), **model_lineage(model_dir)},
                           run_of_model(model_dir, Path(p.train_run), params.registry.experiment, Path(".")),
                           Path("."), known_bpb=measured, evidence=evidence,
                           report=report_folder(params, Path(tmp)))
    decision["yardstick"]["source"] = f"{p.prepared_dir}/{VAL_TEXT_FILE}"
    atomic_write_json(p.promotion, decision)
    print(f"promote: {decision['model_name']} v{decision['version']} — {decision['reason']}")
