"""promote: log the model to MLflow, register a new version (alias `challenger`, lineage tags) and move `champion`
to it only when it beats the current champion on the registry metric; the decision is written as JSON."""

import json
from pathlib import Path

from ultrathink.cli import stage_entry
from ultrathink.config import Params
from ultrathink.io import atomic_write_json
from ultrathink.lineage import lineage_tags
from ultrathink.registry.promote import promote
from ultrathink.registry.tracking import load_run_id


def run(params: Params) -> None:
    p = params.paths
    metrics = json.loads(Path(p.metrics).read_text())
    decision = promote(Path(p.model_dir), Path(p.tokenizer_dir), metrics, params.registry, params.evaluate,
                       lineage_tags(params), load_run_id(Path(p.model_dir)), Path("."))
    atomic_write_json(p.promotion, decision)
    print(f"promote: {decision['model_name']} v{decision['version']} — {decision['reason']}")


if __name__ == "__main__":
    stage_entry("promote")
