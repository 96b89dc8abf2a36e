"""promote: log the model to MLflow and register a new version (alias `challenger`, lineage tags, the yardstick text),
score it and the current champion on that same text (the val documents, as the evaluate stage scored them), and
move `champion` to it only when it is better; the decision, the yardstick and both scores are written as JSON."""

import json
from pathlib import Path

from ultrathink.config import Params
from ultrathink.data.packing import VAL_TEXT_FILE, val_documents
from ultrathink.evaluate import Yardstick
from ultrathink.io import atomic_write_json
from ultrathink.lineage import lineage_tags
from ultrathink.registry.promote import promote
from ultrathink.registry.tracking import run_of_model
from ultrathink.train.warm_start import LINEAGE_FILE


def model_lineage(model_dir: Path) -> dict[str, str]:
    """Tags from the train stage's lineage.json: the configuration's fingerprint and the warm start's parent."""
    path = model_dir / LINEAGE_FILE
    if not path.is_file():
        return {}
    lineage = json.loads(path.read_text())
    return {"fingerprint": lineage["fingerprint"], **(lineage.get("parent") or {})}


def run(params: Params) -> None:
    p = params.paths
    model_dir = Path(p.model_dir)
    metrics = json.loads(Path(p.metrics).read_text())
    yardstick = Yardstick(tuple(val_documents(Path(p.prepared_dir), params.evaluate.max_val_bytes)))
    measured = metrics.get("val_bpb") if metrics.get("yardstick_sha256") == yardstick.sha256 else None
    decision = promote(model_dir, Path(p.tokenizer_dir), yardstick, params.registry, params.evaluate,
                       {**lineage_tags(params), **model_lineage(model_dir)},
                       run_of_model(model_dir, Path(p.train_run), params.registry.experiment, Path(".")),
                       Path("."),
                       known_bpb=measured)
    decision["yardstick"]["source"] = f"{p.prepared_dir}/{VAL_TEXT_FILE}"
    atomic_write_json(p.promotion, decision)
    print(f"promote: {decision['model_name']} v{decision['version']} — {decision['reason']}")

