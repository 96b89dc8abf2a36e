"""Log a trained model to MLflow, register it, and decide whether it becomes the champion.

Every promoted model becomes a new registered version with alias `challenger`. Alias `champion` moves to it
only if its metric (lower is better) beats the current champion's, so `models:/<name>@champion` always names the
best model seen so far. Aliases replace MLflow's deprecated stages.
"""

from __future__ import annotations

import math
import tempfile
import warnings
from importlib.metadata import version as installed_version
from pathlib import Path

import mlflow
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.models import ModelSignature
from mlflow.tracking import MlflowClient
from mlflow.types.schema import ColSpec, ParamSchema, ParamSpec, Schema
from packaging.version import Version

import ultrathink
from ultrathink.config import EvaluateConfig, RegistryConfig
from ultrathink.io import atomic_write_json
from ultrathink.model.export import ExportError, export_hf
from ultrathink.registry.tracking import BAD_VALUE, NOT_FOUND, start_or_resume_run

CHAMPION = "champion"
CHALLENGER = "challenger"
PACKAGE_DIR = Path(ultrathink.__file__).parent
# Passed to MLflow by path, never imported here: importing it would call set_model and load torch for nothing.
PYFUNC_FILE = Path(__file__).with_name("pyfunc_model.py")
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
            "top_k": eval_cfg.top_k, "seed": eval_cfg.seed}


def signature(eval_cfg: EvaluateConfig) -> ModelSignature:
    """Prompts in, texts out; declaring the params lets callers pass `params={"temperature": 0}` to predict.

    The input column is unnamed on purpose: MLflow then accepts a list of str, a str, or a one-column DataFrame
    (a named `prompt` column would make it reject plain lists) and hands predict a DataFrame.
    """
    defaults = generation_defaults(eval_cfg)
    params = ParamSchema([
        ParamSpec("max_new_tokens", "long", defaults["max_new_tokens"]),
        ParamSpec("temperature", "double", float(defaults["temperature"])),
        ParamSpec("top_k", "long", defaults["top_k"]),
        ParamSpec("seed", "long", defaults["seed"]),
    ])
    return ModelSignature(inputs=Schema([ColSpec("string")]),
                          outputs=Schema([ColSpec("string")]), params=params)


def log_pyfunc(model_dir: Path, tokenizer_dir: Path, eval_cfg: EvaluateConfig):
    """Log the model into the active run as models-from-code; returns MLflow's ModelInfo."""
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        # No input_example on purpose: the explicit signature already describes the input, and MLflow would
        # load and run the model at log time to check an example. (The message starts with a colour code.)
        warnings.filterwarnings("ignore", message=".*An input example was not provided")
        generation = Path(tmp) / "generation.json"
        atomic_write_json(generation, generation_defaults(eval_cfg))
        return mlflow.pyfunc.log_model(
            name="model",
            python_model=str(PYFUNC_FILE),
            artifacts={"model": str(model_dir), "tokenizer": str(tokenizer_dir), "generation": str(generation)},
            code_paths=[str(PACKAGE_DIR)],
            pip_requirements=pip_requirements(),
            signature=signature(eval_cfg),
        )


def _metric_of(client: MlflowClient, version: ModelVersion, metric: str) -> float | None:
    """A version's metric: from its tag, else from its run's metrics, else None."""
    try:
        return float(version.tags[metric])
    except (KeyError, ValueError):
        pass
    try:
        return client.get_run(version.run_id).data.metrics.get(metric) if version.run_id else None
    except MlflowException as exc:
        if exc.error_code in (NOT_FOUND, BAD_VALUE):
            return None
        raise


def _current_champion(client: MlflowClient, name: str) -> ModelVersion | None:
    """The champion version, or None if there is none yet. A store failure raises rather than reading as
    "no champion", which would promote the new model unchecked."""
    try:
        return client.get_model_version_by_alias(name, CHAMPION)
    except MlflowException as exc:
        if exc.error_code in (NOT_FOUND, BAD_VALUE):
            return None
        raise


def _decide(value: float, previous: float | None, champion: ModelVersion | None, metric: str) -> tuple[bool, str]:
    """(promote?, why). A diverged (non-finite) model never becomes champion."""
    if not math.isfinite(value):
        return False, f"{metric}={value} is not finite"
    if champion is None:
        return True, "no champion yet"
    if previous is None or not math.isfinite(previous):
        return True, f"champion v{champion.version} has no usable {metric}"
    if value < previous:
        return True, f"{metric} {value:.6g} < champion v{champion.version}'s {previous:.6g}"
    return False, f"{metric} {value:.6g} is not lower than champion v{champion.version}'s {previous:.6g}"


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
    with tempfile.TemporaryDirectory() as tmp:
        try:
            out = export_hf(model_dir, tokenizer_dir, Path(tmp) / "hf")
        except ExportError as exc:
            return f"not exported: {exc}"
        mlflow.log_artifacts(str(out), "hf_export")
    return f"runs:/{mlflow.active_run().info.run_id}/hf_export"


def promote(model_dir: Path, tokenizer_dir: Path, metrics: dict[str, float], cfg: RegistryConfig,
            eval_cfg: EvaluateConfig, tags: dict[str, str], run_id: str | None, root: Path) -> dict:
    """Log, register and tag a new version, alias it `challenger`, and move `champion` to it if it is better.

    Returns the decision as a JSON-serialisable dict (written to reports/promotion.json by the stage).
    """
    if cfg.metric not in metrics:
        raise ValueError(f"metric {cfg.metric!r} missing from metrics (have: {', '.join(sorted(metrics))})")
    value = float(metrics[cfg.metric])
    with start_or_resume_run(cfg.experiment, root, run_id) as run:
        _ensure_run_metrics(metrics)
        info = log_pyfunc(Path(model_dir), Path(tokenizer_dir), eval_cfg)
        hf_export = log_hf_export(Path(model_dir), Path(tokenizer_dir))
        version_tags = {**{k: str(v) for k, v in tags.items()}, cfg.metric: repr(value), "hf_export": hf_export}
        version = mlflow.register_model(info.model_uri, cfg.model_name, tags=version_tags)
    client = MlflowClient()
    client.set_registered_model_alias(cfg.model_name, CHALLENGER, version.version)
    champion = _current_champion(client, cfg.model_name)
    previous = _metric_of(client, champion, cfg.metric) if champion else None
    promoted, reason = _decide(value, previous, champion, cfg.metric)
    if promoted:
        client.set_registered_model_alias(cfg.model_name, CHAMPION, version.version)
    return {
        "model_name": cfg.model_name, "version": int(version.version), "run_id": run.info.run_id,
        "metric": cfg.metric, "value": value,
        "previous_champion_version": int(champion.version) if champion else None,
        "previous_value": previous, "promoted": promoted, "reason": reason, "hf_export": hf_export,
    }
