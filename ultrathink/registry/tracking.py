"""Where MLflow keeps runs, and how one trained model keeps one run across stages.

One store wherever a stage runs: an explicit MLFLOW_TRACKING_URI wins; otherwise the project's own SQLite store in
the original repository, found from DVC's DVC_ROOT (which DVC sets to the original root even inside the temporary
copy of a `dvc exp run --queue` or `--temp` experiment) or from a working directory under `<root>/.dvc/tmp/exps/`.
So a sweep's runs and versions land in the store the MLflow UI shows, and a run carries the DVC experiment's name
and baseline commit as tags. A new SQLite store is created by one process at a time (two processes that create the
same new file at once corrupt it).

The train stage opens a run and leaves its id next to the weights (`mlflow_run.json`). The evaluate and promote
stages are separate processes (DVC runs each stage on its own), so they re-open that run by id: one run then
carries the params, the per-step curves, the eval metrics and the logged model, which is what a reader of the
MLflow UI expects. If the store no longer knows the id (the db was deleted, or the tracking URI points elsewhere),
a fresh run is started with a warning rather than failing the pipeline.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import mlflow
from filelock import FileLock
from mlflow.entities import LifecycleStage, Metric
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from ultrathink.config import Params, PathsConfig, TrainConfig
from ultrathink.errors import StageError
from ultrathink.io import atomic_write_json
from ultrathink.model.model import WEIGHTS_FILE
from ultrathink.hashing import file_sha256

RUN_FILE = "mlflow_run.json"
# Error codes meaning "no such thing" (a malformed id or alias is a BAD_VALUE); anything else is a real failure.
NOT_FOUND, BAD_VALUE = "RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"
ALREADY_EXISTS = "RESOURCE_ALREADY_EXISTS"
DB_FILE = "mlflow.db"
ARTIFACT_DIR = "mlartifacts"
# Schemes that name a tracking server; such a server decides where artifacts go.
_REMOTE_SCHEMES = {"http", "https", "databricks", "databricks-uc", "uc"}


def project_root(root: Path) -> Path:
    """The repository whose store this process writes to: DVC_ROOT (the original repository, also inside a DVC
    experiment's temporary copy), else the part of `root` before `.dvc/tmp/exps/`, else `root` itself."""
    root = Path(root).resolve()
    dvc_root = os.environ.get("DVC_ROOT")
    if dvc_root and Path(dvc_root).is_dir():
        return Path(dvc_root).resolve()
    parts = root.parts
    for i in range(len(parts) - 2):
        if parts[i : i + 3] == (".dvc", "tmp", "exps"):
            return Path(*parts[:i])
    return root


def default_tracking_uri(root: Path) -> str:
    """MLFLOW_TRACKING_URI if the user set one, else a SQLite file in the project's root.

    SQLite rather than ./mlruns files because the model registry (aliases, versions) needs a database backend.
    """
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{project_root(root) / DB_FILE}"


def use_tracking(root: Path) -> str:
    """Point this process's MLflow client at the project's store (created first if new); returns the URI."""
    uri = default_tracking_uri(root)
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    _create_store_once(uri)
    return uri


def sqlite_path(uri: str) -> Path | None:
    """The database file of a SQLite URI (sqlite:////absolute/path or sqlite:///relative/path), else None."""
    parsed = urlparse(uri)
    return Path(parsed.path[1:]) if parsed.scheme == "sqlite" else None


def _create_store_once(uri: str) -> None:
    """Create (migrate) a SQLite store under a lock: two processes creating one new file at once leave it broken
    ("table _alembic_tmp_tags already exists"), as two queued DVC experiments starting together would."""
    db = sqlite_path(uri)
    if db is None or str(db) in _CREATED:
        return
    db.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(db) + ".create.lock", timeout=600):
        MlflowClient(uri, uri).search_registered_models(max_results=1)  # runs the migrations of both stores
    _CREATED.add(str(db))


_CREATED: set[str] = set()  # stores this process has opened under the lock


def experiment_tags() -> dict[str, str]:
    """The DVC experiment a stage runs in (`dvc exp run`, queued or not): its name and baseline commit."""
    names = {"DVC_EXP_NAME": "dvc_exp_name", "DVC_EXP_BASELINE_REV": "dvc_exp_baseline_rev"}
    return {tag: os.environ[var] for var, tag in names.items() if os.environ.get(var)}


def _local_store(uri: str) -> bool:
    return urlparse(uri).scheme not in _REMOTE_SCHEMES


def ensure_experiment(name: str, root: Path) -> str:
    """The id of experiment `name`, creating it (or restoring it from the bin) when needed.

    With a local store, artifacts go to `<project root>/mlartifacts`: MLflow's own default is `./mlruns` relative
    to whatever the working directory happens to be (a DVC experiment's temporary copy, deleted after the run).
    """
    uri = use_tracking(root)
    client = MlflowClient()
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        location = (project_root(root) / ARTIFACT_DIR).as_uri() if _local_store(uri) else None
        try:
            return client.create_experiment(name, artifact_location=location)
        except MlflowException as exc:  # another process (a parallel queued experiment) created it first
            if exc.error_code != ALREADY_EXISTS and "UNIQUE constraint" not in str(exc):
                raise
            experiment = client.get_experiment_by_name(name)
    if experiment.lifecycle_stage == LifecycleStage.DELETED:
        warnings.warn(f"MLflow experiment {name!r} was deleted; restoring it", stacklevel=2)
        client.restore_experiment(experiment.experiment_id)
    return experiment.experiment_id


def _known_run(run_id: str) -> bool:
    """Whether the current store holds a live run with this id. Other errors (store unreachable) propagate."""
    try:
        return MlflowClient().get_run(run_id).info.lifecycle_stage == LifecycleStage.ACTIVE
    except MlflowException as exc:
        if exc.error_code in (NOT_FOUND, BAD_VALUE):
            return False
        raise


def start_or_resume_run(experiment: str, root: Path, run_id: str | None = None,
                        run_name: str | None = None) -> mlflow.ActiveRun:
    """Re-open run `run_id` if the store knows it, else start a new run in `experiment`.

    Use as a context manager (`with start_or_resume_run(...) as run:`); leaving it marks the run finished.
    """
    experiment_id = ensure_experiment(experiment, root)
    if run_id and _known_run(run_id):
        return mlflow.start_run(run_id=run_id)
    if run_id:
        warnings.warn(f"MLflow run {run_id} is unknown to {mlflow.get_tracking_uri()}; starting a new run",
                      stacklevel=2)
    return mlflow.start_run(experiment_id=experiment_id, run_name=run_name or os.environ.get("DVC_EXP_NAME"),
                            tags=experiment_tags())


def save_run_id(model_dir: Path, run_id: str) -> Path:
    """Leave the run id next to the weights so later stages log into the same run."""
    path = Path(model_dir) / RUN_FILE
    atomic_write_json(path, {"run_id": run_id})
    return path


def load_run_id(model_dir: Path) -> str | None:
    """The run id the train stage left in `model_dir`, or None if it left none."""
    path = Path(model_dir) / RUN_FILE
    if not path.exists():
        return None
    return json.loads(path.read_text()).get("run_id")


def run_of_model(model_dir: Path, run_file: Path, experiment: str, root: Path) -> str | None:
    """The MLflow run that trained the weights in `model_dir`: the one `run_file` (the train stage's run facts)
    names when it names these weights; else the newest run tagged with their sha256 (DVC restored the model from
    its cache, or a run elsewhere made the same bytes); else None."""

    weights = file_sha256(Path(model_dir) / WEIGHTS_FILE)
    facts = json.loads(Path(run_file).read_text()) if Path(run_file).is_file() else {}
    if facts.get("model_sha256") == weights and facts.get("run_id"):
        return facts["run_id"]
    use_tracking(root)
    found = mlflow.search_runs(experiment_names=[experiment], filter_string=f"tags.model_sha256 = '{weights}'",
                               order_by=["attributes.start_time DESC"], max_results=1, output_format="list")
    return found[0].info.run_id if found else None


def pin_model_uri(uri: str, root: Path) -> str:
    """`models:/NAME@ALIAS` → `models:/NAME/VERSION`, the version the alias names now (so what is loaded and what
    lineage records are one version); other URIs unchanged."""
    if not uri.startswith("models:/") or "@" not in uri:
        return uri
    name, alias = uri.removeprefix("models:/").split("@", 1)
    use_tracking(root)
    try:
        version = MlflowClient().get_model_version_by_alias(name, alias)
    except MlflowException as exc:
        if exc.error_code in (NOT_FOUND, BAD_VALUE):
            raise StageError(f"{uri}: no version of {name!r} has alias {alias!r} in {mlflow.get_tracking_uri()}") from None
        raise
    return f"models:/{name}/{version.version}"


class StepMetrics:
    """The trainer's per-step metrics, sent to the active MLflow run in batches: one write per `every` steps
    instead of one per step (a SQLite transaction each, several ms: as much as a small model's whole step). Every
    step's point is kept; `flush()` sends what is left (the trainer's last step, or an interrupted run's tail)."""

    def __init__(self, every: int):
        self.every, self.pending = every, []

    def __call__(self, metrics: dict[str, float], step: int) -> None:
        millis = int(time.time() * 1000)
        self.pending += [Metric(k, float(v), millis, step) for k, v in metrics.items()]
        if step % self.every == 0:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        client, run_id = MlflowClient(), mlflow.active_run().info.run_id
        for start in range(0, len(self.pending), MAX_METRICS_PER_BATCH):
            client.log_batch(run_id, metrics=self.pending[start:start + MAX_METRICS_PER_BATCH])
        self.pending = []


MAX_METRICS_PER_BATCH = 1000  # MLflow's limit for one log_batch call


class TensorBoardScalars:
    """train.tensorboard: every step's metrics (routing health included) as TensorBoard scalars in `directory`
    (`tensorboard --logdir paths.tensorboard_dir`: one folder per MLflow run)."""

    def __init__(self, directory: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(directory))

    def __call__(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def flush(self) -> None:
        self.writer.flush()


class MetricSinks:
    """Several per-step metric sinks as one (the trainer calls one)."""

    def __init__(self, *sinks):
        self.sinks = sinks

    def __call__(self, metrics: dict[str, float], step: int) -> None:
        for sink in self.sinks:
            sink(metrics, step)

    def flush(self) -> None:
        for sink in self.sinks:
            sink.flush()


def flat_keys(prefix: str, value) -> dict[str, object]:
    """{'a': {'b': 1}} → {'prefix.a.b': 1}: MLflow keys for nested sections and reports."""
    if isinstance(value, dict):
        return {k: v for key, sub in value.items() for k, v in flat_keys(f"{prefix}.{key}", sub).items()}
    return {prefix: value}


def flat_params(params: Params) -> dict[str, object]:
    """The data, tokenizer, model and train knobs as MLflow params (`train.lr`, ...)."""
    dump = params.model_dump(by_alias=True)
    sections = ("data", "tokenizer", "model", "train")
    return {k: v for section in sections for k, v in flat_keys(section, dump[section]).items()}


def cleaning_metrics(validate_report: str) -> dict[str, float]:
    """The validate stage's counts (documents dropped per cleaning step, matches per constitution principle)."""
    cleaning = json.loads(Path(validate_report).read_text()).get("cleaning", {})
    return {k: float(v) for k, v in flat_keys("cleaning", cleaning).items() if isinstance(v, (int, float))}


def metric_sinks(train: TrainConfig, paths: PathsConfig, run_id: str) -> MetricSinks:
    """Every step's metrics to the MLflow run (in batches, every train.log_every steps), and to TensorBoard
    (paths.tensorboard_dir/<run id>) when train.tensorboard is on."""
    sinks = [StepMetrics(train.log_every)]
    if train.tensorboard:
        sinks.append(TensorBoardScalars(Path(paths.tensorboard_dir) / run_id))
    return MetricSinks(*sinks)


@contextlib.contextmanager
def training_run(checkpoint_dir: Path, resumed: bool, experiment: str, train: TrainConfig, paths: PathsConfig,
                 run_name: str | None = None) -> Iterator[tuple[mlflow.ActiveRun, MetricSinks]]:
    """The MLflow run of one configuration's training, for train and finetune alike: a resumed run re-opens the
    run its checkpoints recorded (else a new one starts, and its id is recorded beside them); yields it with the
    per-step metric sinks, whose last points are flushed however the block ends."""
    run_id = load_run_id(checkpoint_dir) if resumed else None
    with start_or_resume_run(experiment, Path("."), run_id, run_name=run_name) as run:
        save_run_id(checkpoint_dir, run.info.run_id)
        sinks = metric_sinks(train, paths, run.info.run_id)
        try:
            yield run, sinks
        finally:
            sinks.flush()  # the steps since the last batch of points
