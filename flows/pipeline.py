"""The pipeline as a Prefect flow.

The stage list comes from dvc.yaml (ultrathink.pipeline.stage_order), and each stage runs through DVC
(`dvc repro --single-item <stage>`), so DVC still decides what is stale, records dvc.lock, and skips what is
unchanged: after a flow run `dvc status` is clean. Prefect adds the run page, logs, a markdown summary, and retries
for the stages where a retry is safe: promote, promote_finetuned and promote_aligned, whose registration is idempotent (the same run
and weights are the same registered version) and whose alias move is a locked compare-and-set, so a store hiccup (SQLite busy, a server
restart) does not fail a nightly run. Other stages are not retried: a failure there is the data's or the code's, and
running it again would fail the same way. Prefect's own result cache stays off: two caches that can disagree are
worse than one.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import ultrathink  # noqa: F401  (quiet, offline environment before Prefect and DVC import)
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from ultrathink.config import load_params
from ultrathink.pipeline import stage_order


# Stages safe to retry, with how many retries (see the module docstring).
RETRIES = {"promote": 2, "promote_finetuned": 2, "promote_aligned": 2}
RETRY_DELAY_SECONDS = 10


@task(cache_policy=NO_CACHE, task_run_name="{name}")
def reproduce(name: str, root: str) -> dict:
    """Run one stage if DVC finds it stale; report whether it ran and how long it took."""
    from dvc.repo import Repo

    started = time.perf_counter()
    with Repo(root) as repo:
        ran = repo.reproduce(name, single_item=True)
    seconds = time.perf_counter() - started
    get_run_logger().info("%s: %s in %.1f s", name, "ran" if ran else "up to date, skipped", seconds)
    return {"stage": name, "ran": bool(ran), "seconds": round(seconds, 2)}


def flat_rows(report: dict, prefix: str = "") -> dict:
    """A report's numbers and strings, nested keys joined by "/" (metrics.json's tasks: task/metric); lists left
    out."""
    rows = {}
    for key, value in report.items():
        if isinstance(value, dict):
            rows.update(flat_rows(value, f"{prefix}{key}/"))
        elif not isinstance(value, list):
            rows[f"{prefix}{key}"] = value
    return rows


def summary_markdown(results: list[dict], root: Path, params) -> str:
    lines = ["# UltraThink pipeline", "", "| stage | ran | seconds |", "|---|---|---|"]
    lines += [f"| {r['stage']} | {'yes' if r['ran'] else 'skipped'} | {r['seconds']} |" for r in results]
    p = params.paths
    for title, path in (("Metrics", p.metrics), ("Promotion", p.promotion), ("Fine-tuning", p.finetune_report),
                        ("Fine-tuned promotion", p.finetune_promotion), ("Alignment", p.align_report),
                        ("Aligned promotion", p.align_promotion)):
        file = root / path
        if file.exists():
            rows = flat_rows(json.loads(file.read_text()))
            lines += ["", f"## {title}", "", "| key | value |", "|---|---|"]
            lines += [f"| {k} | {v} |" for k, v in rows.items()]
    return "\n".join(lines)


@flow(name="ultrathink-pipeline", log_prints=True)
def pipeline(root: str = ".") -> list[dict]:
    """validate → tokenizer → prepare → train → evaluate → promote → finetune → promote_finetuned → align →
    promote_aligned (finetune's two do something only with finetune.enabled, align's with align.enabled), each only
    if stale. A failed stage fails the flow, so nothing after it
    (promotion included) runs."""
    params = load_params(Path(root) / "params.yaml")  # bad params fail here, before any work
    results = [reproduce.with_options(retries=RETRIES.get(name, 0), retry_delay_seconds=RETRY_DELAY_SECONDS)(name, root)
               for name in stage_order(root)]
    create_markdown_artifact(summary_markdown(results, Path(root), params), key="ultrathink-summary",
                             description="stages run and the model's metrics")
    return results


if __name__ == "__main__":
    pipeline()
