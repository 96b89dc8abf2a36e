"""Downstream tasks through lm-evaluation-harness: which tasks run (evaluate.tasks), the built-in task made from the
held-out documents, checks that stop with the task and the reason named before any model runs, running the tasks on
a model (in this process, or under a registered model's own code), their scores, and the task guard of promotion.

The scoring itself is lm-eval's, on the `LM` of ultrathink/harness.py; nothing here scores text.

The built-in task, `heldout_continuation`: "which of these CHOICES passages does this one continue?". Held-out
documents are cut after a word (the first CONTINUATION_WORDS, then every 2 × CONTINUATION_WORDS more); an
example is the CONTINUATION_WORDS words after a cut, and as choices the text before that cut and the texts before cuts of
CHOICES - 1 other held-out documents. The model scores the continuation after each choice and picks the likeliest
(lm-eval's "multiple input" form, as winogrande's; metric acc). Every choice is scored on the same words, so how
likely they are on their own cancels out: only how well each context predicts them counts. A model that has learnt
nothing has no reason to prefer the right context and is right 1 time in CHOICES; one that follows syntax and topic
across the cut does better (the reference model of docs/evaluation.md: 0.67; untrained: 0.28, chance 0.25). It is
written in lm-eval's own YAML format beside the reports, so `lm_eval --include_path reports/tasks --tasks
heldout_continuation` runs it too.
"""

from __future__ import annotations

import difflib
import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ultrathink.errors import StageError
from ultrathink.hashing import file_sha256, json_hash
from ultrathink.io import atomic_write_text
from ultrathink.scoring import document_prefix
from ultrathink.text_eval import ModelFiles, run_under_model_code

BUILTIN_TASK = "heldout_continuation"
METRIC_PREFIX = "tasks/"  # MLflow metrics and version tags tasks/<task>/<metric>
TASKS_FOLDER = "eval_tasks"  # the project's own task YAMLs: a dependency of the evaluate and promote stages
CHOICES = 4
CONTINUATION_WORDS = 8  # words on each side of a cut (fewer for a corpus of short documents)
MAX_EXAMPLES = 1000  # ±1.6 points of stderr at 50%; from the first held-out documents, in order
SEED = 0


class TaskError(StageError):
    """A task cannot run; the message names it and says why."""


# ---- the built-in task -------------------------------------------------------------------------------------------
def cuts_of(documents, words: int) -> list[tuple[int, str, str]]:
    """(document index, the text before a cut, the `words` words after it): a cut after the first `words` words
    of each document, then every 2 × `words` more, up to MAX_EXAMPLES in all."""
    cuts = []
    for index, text in enumerate(documents):
        spans = list(re.finditer(r"\S+", text))
        for k in range(words, len(spans) - words + 1, 2 * words):
            cuts.append((index, text[: spans[k - 1].end()], " ".join(w.group() for w in spans[k : k + words])))
        if len(cuts) >= MAX_EXAMPLES:
            break
    return cuts[:MAX_EXAMPLES]


def continuation_examples(documents, seed: int = SEED) -> tuple[list[dict], int]:
    """Examples of the built-in task from documents (see the module's docstring): {contexts, continuation,
    label}, label the index of the right context; and the words on each side of a cut: CONTINUATION_WORDS, or
    fewer (halved down to 2) when fewer than CHOICES documents are long enough (a corpus of short lines)."""
    words = CONTINUATION_WORDS
    while len({index for index, _, _ in cuts_of(documents, words)}) < CHOICES and words > 2:
        words //= 2
    cuts = cuts_of(documents, words)
    rng = random.Random(seed)
    examples = []
    for index, context, passage in cuts:
        # Wrong contexts come from other documents: an earlier part of the same one could lead to it as well.
        others = sorted({c[1] for c in cuts if c[0] != index and c[1] != context})
        if len(others) < CHOICES - 1:
            continue
        others = rng.sample(others, CHOICES - 1)
        label = rng.randrange(CHOICES)
        examples.append({"contexts": others[:label] + [context] + others[label:], "continuation": passage,
                         "label": label})
    if not examples:
        raise TaskError(f"{BUILTIN_TASK}: fewer than {CHOICES} different held-out documents have {2 * words} words "
                        f"or more (a larger val split: prepare.val_fraction; or leave the task out of "
                        f"evaluate.tasks)")
    return examples, words


def write_builtin_task(documents, directory: Path) -> Path:
    """Write the built-in task (its YAML and its JSON lines) into `directory`; returns the YAML's path. The data
    file is named relative to the working directory (the project's root), as lm-eval reads it."""
    directory = Path(directory)
    data = directory / f"{BUILTIN_TASK}.jsonl"
    config = {
        "task": BUILTIN_TASK,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test",
        "output_type": "multiple_choice",
        # lm-eval's "multiple input" form (as winogrande's): doc_to_text gives the right choice's index, the
        # choices are contexts, and every one is scored on the same continuation.
        "doc_to_text": "label",
        "doc_to_choice": "contexts",
        "doc_to_target": "continuation",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
        "metadata": {"version": 2.0, "chance": 1 / CHOICES,
                     "description": "which of these held-out passages do the words continue? (ultrathink/"
                                    "downstream.py)"},
    }
    directory.mkdir(parents=True, exist_ok=True)
    examples, words = continuation_examples(documents)
    config["metadata"]["words"] = words
    atomic_write_text(data, "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in examples))
    path = directory / f"{BUILTIN_TASK}.yaml"
    atomic_write_text(path, yaml.safe_dump(config, sort_keys=False, allow_unicode=True))
    return path


# ---- which tasks, and where lm-eval finds them ---------------------------------------------------------------------
def is_task_file(spec: str) -> bool:
    return spec.endswith((".yaml", ".yml")) or "/" in spec


@dataclass(frozen=True)
class TaskSet:
    """Tasks as lm-eval is given them: names and YAML paths; `include_path`: folders whose task names `specs` use
    (the built-in task's); `defaults`: some name is one of lm-eval's own tasks (indexing them takes seconds)."""

    specs: tuple[str, ...]
    include_path: tuple[str, ...] = ()
    defaults: bool = False
    files: tuple[str, ...] = field(default=(), compare=False)  # local YAMLs and their data files: the tasks' data

    def manager(self):
        from lm_eval.tasks import TaskManager

        return TaskManager(include_path=list(self.include_path) or None, include_defaults=self.defaults)

    def sha256(self, limit: int | None) -> str:
        """Names the task data: the specs, the limit and every local file's bytes."""
        return json_hash({"specs": self.specs, "limit": limit, "files": {f: file_sha256(f) for f in self.files}})


def task_set(specs, builtin_dir: Path | None = None) -> TaskSet:
    """The TaskSet of `specs` (evaluate.tasks or --tasks). Raises TaskError for a task file that does not exist,
    or does not parse, or whose data file is missing, and for the built-in task when it has not been written."""
    include, files, defaults = [], [], False
    for spec in specs:
        if spec == BUILTIN_TASK:
            path = Path(builtin_dir or "") / f"{BUILTIN_TASK}.yaml"
            if builtin_dir is None or not path.is_file():
                raise TaskError(f"task {BUILTIN_TASK!r}: {path} does not exist; the evaluate stage writes it "
                                f"(dvc repro evaluate)")
            include.append(str(builtin_dir))
            files += [str(path), *task_data_files(path)]
        elif is_task_file(spec):
            files += [spec, *task_data_files(Path(spec))]
        else:
            defaults = True
    return TaskSet(tuple(specs), tuple(dict.fromkeys(include)), defaults, tuple(dict.fromkeys(files)))


def task_data_files(path: Path) -> list[str]:
    """The local data files a task YAML names (dataset_kwargs.data_files); raises TaskError naming the file when
    it is missing or does not parse, or when a data file it names is missing."""
    from lm_eval.tasks._yaml_loader import load_yaml  # lm-eval's reader: includes and !function tags

    if not path.is_file():
        raise TaskError(f"task file {path} does not exist")
    try:
        config = load_yaml(path, resolve_func=False)
    except yaml.YAMLError as exc:
        raise TaskError(f"task file {path} is not valid YAML: {exc}") from None
    except (OSError, ValueError) as exc:  # an include that is missing, or a file that holds no mapping
        raise TaskError(f"task file {path} cannot be read: {exc}") from None
    data_files = (config.get("dataset_kwargs") or {}).get("data_files") or []
    if isinstance(data_files, dict):
        data_files = list(data_files.values())
    named = [data_files] if isinstance(data_files, str) else [f for group in data_files
                                                              for f in ([group] if isinstance(group, str) else group)]
    missing = [f for f in named if "://" not in f and not any(Path().glob(f))]
    if missing:
        raise TaskError(f"task {config.get('task', path)!r} ({path}): its data file {missing[0]} does not exist "
                        f"(dataset_kwargs.data_files; relative paths are read from the project's root)")
    return [str(p) for f in named if "://" not in f for p in sorted(Path().glob(f))]


@dataclass
class LoadedTasks:
    """lm-eval's Task objects of a TaskSet, and the TaskManager that found them."""

    manager: object
    tasks: list


def load_tasks(tasks: TaskSet) -> LoadedTasks:
    """Load every task of the set, each on its own so that a failure names its task: unknown names (with the
    nearest known ones), and datasets that cannot be read, e.g. hub datasets while offline."""
    manager = tasks.manager()
    loaded = []
    for spec in tasks.specs:
        try:
            loaded += list(manager.load([spec])["tasks"].values())
        except KeyError:
            near = difflib.get_close_matches(spec, manager.all_tasks, n=3, cutoff=0.6)
            raise TaskError(f"task {spec!r} is not a task lm-eval knows"
                            + (f" (did you mean {', '.join(near)}?)" if near else "")
                            + "; give a registered name (lm_eval ls tasks) or the path of a task YAML") from None
        except ConnectionError as exc:
            raise TaskError(f"task {spec!r} needs its dataset from the Hugging Face Hub and this run is offline "
                            f"({exc}). Download it once where there is a network (datasets.load_dataset fills "
                            f"the cache), or point a task YAML at local data files") from None
        except Exception as exc:  # noqa: BLE001 - a dataset that does not load: name the task and the cause
            raise TaskError(f"task {spec!r} cannot be loaded: {type(exc).__name__}: {exc}") from None
    return LoadedTasks(manager, loaded)


# ---- running them ------------------------------------------------------------------------------------------------
def frame(tokenizer) -> list[int]:
    """What precedes every request: the EOS before each packed document and the tokenizer's prefix."""
    return [tokenizer.eos_token_id, *document_prefix(tokenizer)]


def run_loaded(model, tokenizer, tasks: LoadedTasks, limit: int | None, batch_size: int) -> dict:
    """lm-eval's results of loaded tasks on a model of this process."""
    from ultrathink import harness  # lm-eval is imported when tasks run, not with this module

    return harness.run_tasks(model, tokenizer, tasks.tasks, frame(tokenizer), limit, batch_size,
                             manager=tasks.manager)


def evaluate_model(files: ModelFiles, tasks: TaskSet, limit: int | None, batch_size: int, device=None) -> dict:
    """lm-eval's results of the tasks on a model named by its files: under its own code when it is a registered
    model (files.code_dir), else in this process."""
    from ultrathink.device import resolve_device
    from ultrathink.model import UltraThink
    from ultrathink.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(files.tokenizer_dir)
    if files.code_dir is None:
        model = UltraThink.from_pretrained(files.model_dir, device=resolve_device(device))
        return run_loaded(model, tokenizer, load_tasks(tasks), limit, batch_size)
    from ultrathink import harness

    load_tasks(tasks)  # stop here, naming the task, rather than in the model's process
    return run_under_model_code(files, harness, "run_tasks", {
        "tasks": list(tasks.specs), "frame": frame(tokenizer), "limit": limit, "batch_size": batch_size,
        "include_path": list(tasks.include_path), "defaults": tasks.defaults}, device, what="evaluating tasks on")


# ---- their scores ------------------------------------------------------------------------------------------------
def task_scores(results: dict) -> dict[str, dict]:
    """{task: {"metrics": {metric: value}, "stderr": {metric: value or None}, "n": examples,
    "higher_is_better": {metric: bool}}} from lm-eval's results; a metric under a filter other than lm-eval's
    "none" is named metric_filter. The metrics keep lm-eval's order: the first is the task's primary one."""
    scores = {}
    for task, row in results["results"].items():
        directions = results.get("higher_is_better", {}).get(task, {})
        entry = {"metrics": {}, "stderr": {}, "higher_is_better": {},
                 "n": (results.get("n-samples", {}).get(task) or {}).get("effective")}
        for key, value in row.items():
            if "," not in key:
                continue
            metric, filtered = key.split(",", 1)
            stderr = metric.endswith("_stderr")
            base = metric.removesuffix("_stderr")
            name = base if filtered == "none" else f"{base}_{filtered}"
            if stderr:
                entry["stderr"][name] = value if isinstance(value, (int, float)) else None
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                entry["metrics"][name] = float(value)
                entry["higher_is_better"][name] = bool(directions.get(base, True))
        scores[task] = entry
    return scores


def compact_scores(scores: dict[str, dict]) -> dict[str, dict]:
    """{task: {metric: value, metric_stderr: stderr, n: examples}}: what metrics.json keeps (dvc metrics show)."""
    return {task: {**{k: v for metric, value in entry["metrics"].items()
                      for k, v in ((metric, value), (f"{metric}_stderr", entry["stderr"].get(metric)))
                      if v is not None}, "n": entry.get("n")}
            for task, entry in scores.items()}


def flat_metrics(scores: dict[str, dict]) -> dict[str, float]:
    """`tasks/<task>/<metric>`: value (METRIC_PREFIX), in names MLflow accepts."""
    return {re.sub(r"[^\w\-./ ]", "_", f"{METRIC_PREFIX}{task}/{metric}"): value
            for task, entry in scores.items() for metric, value in entry["metrics"].items()}


def score_table(scores: dict[str, dict]) -> list[tuple[str, str, str, str]]:
    """Rows (task, metric, value ± stderr, examples) for printing."""
    rows = []
    for task, entry in scores.items():
        for metric, value in entry["metrics"].items():
            stderr = entry["stderr"].get(metric)
            arrow = "↑" if entry["higher_is_better"].get(metric, True) else "↓"
            rows.append((task, f"{metric} {arrow}", f"{value:.4f}" + (f" ± {stderr:.4f}" if stderr else ""),
                         str(entry.get("n") or "?")))
    return rows


# ---- the task guard of promotion ---------------------------------------------------------------------------------
def guard_metric(scores: dict[str, dict], key: str) -> tuple[str, str]:
    """(task, metric) a task_guard key names: `task` (its primary metric) or `task/metric`."""
    task, _, metric = key.partition("/")
    if task not in scores:
        raise TaskError(f"registry.task_guard: {task!r} was not scored (scored: {', '.join(scores) or 'none'}); "
                        f"add it to evaluate.tasks")
    known = scores[task]["metrics"]
    if metric and metric not in known:
        raise TaskError(f"registry.task_guard: task {task!r} has no metric {metric!r} (it has "
                        f"{', '.join(known)})")
    if not known:
        raise TaskError(f"registry.task_guard: task {task!r} reported no metric")
    return task, metric or next(iter(known))


def check_guard(guard: dict[str, float], challenger: dict[str, dict], champion: dict[str, dict]) -> dict:
    """Whether the challenger's scores drop below the champion's by more than each key's max_drop (in the
    metric's own units; a drop is a fall of a higher-is-better metric or a rise of a lower-is-better one):
    {"passed": bool, "checks": [{task, metric, challenger, champion, drop, max_drop, passed}], "reason": str}."""
    checks = []
    for key, max_drop in guard.items():
        task, metric = guard_metric(challenger, key)
        ours = challenger[task]["metrics"][metric]
        theirs = champion.get(task, {}).get("metrics", {}).get(metric)
        if theirs is None:
            raise TaskError(f"registry.task_guard: the champion reported no {task}/{metric}")
        higher = challenger[task]["higher_is_better"].get(metric, True)
        drop = (theirs - ours) if higher else (ours - theirs)
        checks.append({"task": task, "metric": metric, "challenger": ours, "champion": theirs, "drop": drop,
                       "max_drop": max_drop, "passed": drop <= max_drop})
    failed = [c for c in checks if not c["passed"]]
    reason = "; ".join(f"{c['task']}/{c['metric']} {c['challenger']:.4g} is {c['drop']:.4g} worse than the "
                       f"champion's {c['champion']:.4g} (at most {c['max_drop']:g} allowed)" for c in failed)
    return {"passed": not failed, "checks": checks, "reason": reason}
