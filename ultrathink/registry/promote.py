"""Log a trained model to MLflow, register it, and decide whether it becomes the champion.

Every promoted model becomes a new registered version with alias `challenger`, tagged with its lineage, its bits
per byte and the yardstick text that was measured on (logged in its run). Alias `champion` moves to it only if it
beats the current champion on that same text (ultrathink.registry.champion), so `models:/<name>@champion` names the
better of the two on the data the new model was validated on. Aliases replace MLflow's deprecated stages.
"""

from __future__ import annotations

import tempfile
import warnings
from dataclasses import dataclass, field
from importlib.metadata import version as installed_version
from pathlib import Path

import mlflow
from mlflow.entities.model_registry import ModelVersion
from mlflow.models import ModelSignature
from mlflow.tracking import MlflowClient
from mlflow.types.schema import ColSpec, ParamSchema, ParamSpec, Schema
from packaging.version import Version

import ultrathink
from ultrathink import downstream
from ultrathink.config import EvaluateConfig, RegistryConfig
from ultrathink.evaluate import Yardstick
from ultrathink.io import atomic_write_json
from ultrathink.model.model import WEIGHTS_FILE
from ultrathink.registry.champion import CHALLENGER, CHAMPION, YARDSTICK_ARTIFACT, Guard, actor, decide_and_move
from ultrathink.registry.models import resolve_model_files
from ultrathink.registry.tracking import start_or_resume_run
from ultrathink.text_eval import ModelFiles
from ultrathink.hashing import file_sha256
PACKAGE_DIR = Path(ultrathink.__file__).parent
# Passed to MLflow by path, never imported here: importing it would call set_model and load torch for nothing.
PYFUNC_FILE = Path(__file__).with_name("pyfunc_model.py")
REPORT_ARTIFACT = "report"  # the report card's folder among a registered model's artifacts
# What pyfunc_model.py and the ultrathink package import. Listing them saves MLflow from inferring requirements,
# which loads the model in a subprocess (~10 s).
REQUIREMENTS = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "pydantic", "pyyaml")


def champion_uri(cfg: RegistryConfig) -> str:
    """The URI that always loads the current best model."""
    return f"models:/{cfg.model_name}@{CHAMPION}"


def pip_requirements() -> list[str]:
    """Pins of the installed versions, without local labels such as +cpu so pip can resolve them."""
    return [f"{name}=={Version(installed_version(name)).public}" for name in REQUIREMENTS]


def generation_defaults(eval_cfg: EvaluateConfig) -> dict:
    return {"max_new_tokens": eval_cfg.max_new_tokens, "temperature": eval_cfg.temperature,
            "top_k": eval_cfg.top_k, "top_p": eval_cfg.top_p, "seed": eval_cfg.seed}


def signature(eval_cfg: EvaluateConfig) -> ModelSignature:
    """Prompts in, texts out; declaring the params lets callers pass `params={"temperature": 0}` to predict (and
    `{"device": "cpu"}`: see pyfunc_model for where the model runs).

    The input column is unnamed on purpose: MLflow then accepts a list of str, a str, or a one-column DataFrame
    (a named `prompt` column would make it reject plain lists) and hands predict a DataFrame.
    """
    defaults = generation_defaults(eval_cfg)
    params = ParamSchema([
        ParamSpec("max_new_tokens", "long", defaults["max_new_tokens"]),
        ParamSpec("temperature", "double", float(defaults["temperature"])),
        ParamSpec("top_k", "long", defaults["top_k"]),
        ParamSpec("top_p", "double", float(defaults["top_p"])),
        ParamSpec("seed", "long", defaults["seed"]),
        ParamSpec("device", "string", "auto"),  # "cpu", "cuda:1", ...; auto keeps where loading put it
    ])
    return ModelSignature(inputs=Schema([ColSpec("string")]),
                          outputs=Schema([ColSpec("string")]), params=params)


def log_pyfunc(model_dir: Path, tokenizer_dir: Path, eval_cfg: EvaluateConfig, report: Path | None = None):
    """Log the model into the active run as models-from-code; returns MLflow's ModelInfo. `report`: a folder
    (the report card) that goes with the model as its `report` artifact."""
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        # No input_example on purpose: the explicit signature already describes the input, and MLflow would
        # load and run the model at log time to check an example. (The message starts with a colour code.)
        warnings.filterwarnings("ignore", message=".*An input example was not provided")
        generation = Path(tmp) / "generation.json"
        atomic_write_json(generation, generation_defaults(eval_cfg))
        return mlflow.pyfunc.log_model(
            name="model",
            python_model=str(PYFUNC_FILE),
            artifacts={"model": str(model_dir), "tokenizer": str(tokenizer_dir), "generation": str(generation),
                       **({REPORT_ARTIFACT: str(report)} if report else {})},
            code_paths=[str(PACKAGE_DIR)],
            pip_requirements=pip_requirements(),
            signature=signature(eval_cfg),
        )


def _ensure_run_metrics(metrics: dict[str, float]) -> None:
    """Log the eval metrics if the active run lacks them (a fresh run, when the train run was not found)."""
    run = mlflow.active_run()
    logged = mlflow.get_run(run.info.run_id).data.metrics
    missing = {k: float(v) for k, v in metrics.items() if k not in logged}
    if missing:
        mlflow.log_metrics(missing)


def log_hf_export(model_dir: Path, tokenizer_dir: Path) -> str:
    """Export the model to a transformers directory and log it in the active run as `hf_export`. Returns its URI,
    or why this architecture has no transformers equivalent (then nothing is logged)."""
    # Imported here, not at the top: transformers is about 3 s of a promote that registers nothing new (a retry, or
    # weights this run has registered before) and of `ultrathink registry`'s task guard, which import this module.
    from ultrathink.model.export import ExportError, export_hf

    with tempfile.TemporaryDirectory() as tmp:
        try:
            out = export_hf(model_dir, tokenizer_dir, Path(tmp) / "hf")
        except ExportError as exc:
            return f"not exported: {exc}"
        mlflow.log_artifacts(str(out), "hf_export")
    return f"runs:/{mlflow.active_run().info.run_id}/hf_export"


@dataclass
class TaskEvidence:
    """The challenger's downstream scores (downstream.task_scores), the tasks and settings they were scored with,
    and registry.task_guard: what it takes to score another version on the same task data."""

    scores: dict[str, dict]
    tasks: downstream.TaskSet
    limit: int | None
    batch_size: int
    guard: dict[str, float] = field(default_factory=dict)

    def tags(self) -> dict[str, str]:
        return {**{k: repr(v) for k, v in downstream.flat_metrics(self.scores).items()},
                "tasks_sha256": self.tasks.sha256(self.limit)}

    def guard_for(self, name: str) -> Guard | None:
        """The task guard of registry.task_guard (None when empty): scores the champion on the same tasks under its
        own code and compares. A guarded task the challenger has no score for raises TaskError here, before any
        version is registered."""
        if not self.guard:
            return None
        for key in self.guard:
            downstream.guard_metric(self.scores, key)

        def check(champion: int) -> dict:
            results = downstream.evaluate_model(resolve_model_files(f"models:/{name}/{champion}"), self.tasks,
                                                self.limit, self.batch_size)
            record = downstream.check_guard(self.guard, self.scores, downstream.task_scores(results))
            return {**record, "tasks_sha256": self.tasks.sha256(self.limit)}

        return check


def version_evidence(name: str, version: int, tasks: downstream.TaskSet, limit: int | None, batch_size: int,
                     guard: dict[str, float]) -> TaskEvidence:
    """A registered version's scores on the project's tasks, under its own code (`ultrathink registry promote`
    guards with these)."""
    results = downstream.evaluate_model(resolve_model_files(f"models:/{name}/{version}"), tasks, limit, batch_size)
    return TaskEvidence(downstream.task_scores(results), tasks, limit, batch_size, guard)


def registered_version(client: MlflowClient, name: str, run_id: str, model_sha256: str) -> ModelVersion | None:
    """The version this run already registered for these exact weights: a retried promote reuses it rather than
    registering the same model twice."""
    for version in client.search_model_versions(f"name='{name}' and run_id='{run_id}'"):
        if version.tags.get("model_sha256") == model_sha256:
            return version
    return None


def promote(model_dir: Path, tokenizer_dir: Path, yardstick: Yardstick, cfg: RegistryConfig,
            eval_cfg: EvaluateConfig, tags: dict[str, str], run_id: str | None, root: Path,
            known_bpb: float | None = None, name: str | None = None, evidence: TaskEvidence | None = None,
            report: Path | None = None) -> dict:
    """Register the model as a new version (alias `challenger`) of `name` (default registry.model_name), score it
    and the current champion on the same yardstick, and move `champion` to it only if it is better
    (compare-and-set, see registry.champion).

    `known_bpb`: the model's bits per byte on this very yardstick when already measured (the evaluate stage's
    val_bpb, with the same yardstick sha256), else it is scored here. `evidence`: the model's downstream task
    scores, tagged on the version, and the task guard they are checked with. Returns the decision as a
    JSON-serialisable dict (written to reports/promotion.json by the stage). `report`: a folder named `report`
    holding the report card, logged with the model (its artifacts/report; the version's `report_card` tag)."""
    model_dir, tokenizer_dir = Path(model_dir), Path(tokenizer_dir)
    name = name or cfg.model_name
    bpb = float(known_bpb if known_bpb is not None else yardstick.score(ModelFiles(model_dir, tokenizer_dir)))
    report_name = next((p.name for p in Path(report).glob("*.md")), "") if report else ""
    weights_sha = file_sha256(model_dir / WEIGHTS_FILE)
    guard = evidence.guard_for(name) if evidence else None
    with start_or_resume_run(cfg.experiment, root, run_id) as run:
        client = MlflowClient()
        _ensure_run_metrics({"val_bpb": bpb})
        version = registered_version(client, name, run.info.run_id, weights_sha)
        if version is None:
            mlflow.log_text(yardstick.jsonl(), YARDSTICK_ARTIFACT)
            info = log_pyfunc(model_dir, tokenizer_dir, eval_cfg, report)
            hf_export = log_hf_export(model_dir, tokenizer_dir)
            version_tags = {**{k: str(v) for k, v in tags.items()}, "val_bpb": repr(bpb),
                            "yardstick_sha256": yardstick.sha256, "yardstick_bytes": str(yardstick.bytes),
                            "model_sha256": weights_sha, "hf_export": hf_export,
                            **({"report_card": f"artifacts/{REPORT_ARTIFACT}/{report_name}"} if report else {}),
                            **(evidence.tags() if evidence else {})}
            version = mlflow.register_model(info.model_uri, name, tags=version_tags)
    number = int(version.version)
    client.set_registered_model_alias(name, CHALLENGER, str(number))
    decision = decide_and_move(client, name, number, bpb, yardstick, root, by=f"promote stage ({actor()})",
                               guard=guard)
    return {
        "model_name": name, "version": number, "run_id": run.info.run_id,
        "yardstick": yardstick.describe(), "value": bpb, "metric": yardstick.metric,
        "previous_champion_version": decision.champion_version, "previous_value": decision.champion_bpb,
        "promoted": decision.promoted, "reason": decision.reason, "hf_export": version.tags.get("hf_export"),
        "tasks": downstream.compact_scores(evidence.scores) if evidence else {}, "task_guard": decision.task_guard,
    }
