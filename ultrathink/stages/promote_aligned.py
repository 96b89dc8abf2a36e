"""promote_aligned: register the aligned model as a version of registry.aligned_name (alias `challenger`) and move
its `champion` to it only when its own likelihoods rank the held-out preference pairs better than the champion's
do (evaluate.PreferenceYardstick: each model under its own chat tokenizer and code, no reference model): the
guarded promotion of the other stages, on another yardstick. Off (align.enabled false), it records that there was
nothing to promote."""

import json
from pathlib import Path

from ultrathink.align.outputs import HELDOUT_FILE, STATUS_FILE
from ultrathink.config import Params
from ultrathink.config.fingerprint import section_hash
from ultrathink.io import atomic_write_json


def run(params: Params) -> None:
    p = params.paths
    out = Path(p.aligned_dir)
    status = json.loads((out / STATUS_FILE).read_text())
    if not status["enabled"]:
        atomic_write_json(p.align_promotion, {"promoted": False, "reason": "align.enabled is false: no aligned "
                                              "model"})
        print("promote_aligned: nothing to promote (align.enabled: false)")
        return
    from ultrathink.align.preferences import read_pairs
    from ultrathink.align.train import ALIGN_CODE
    from ultrathink.evaluate import PreferenceYardstick
    from ultrathink.lineage import code_hash, git_commit
    from ultrathink.registry.promote import promote
    from ultrathink.registry.tracking import load_run_id

    yardstick = PreferenceYardstick(tuple(read_pairs(out / HELDOUT_FILE)))
    tags = {"git_commit": git_commit(), "params_hash": section_hash(params, "align", "train"),
            "code_hash": code_hash(ALIGN_CODE), "fingerprint": status["fingerprint"],
            "data_hash": status["data_hash"], **status["base"]}
    decision = promote(out / "model", out / "tokenizer", yardstick, params.registry, params.evaluate, tags,
                       load_run_id(out), Path("."), known_bpb=status["metrics"]["align_preference_bits"],
                       name=params.registry.aligned_name)
    decision["yardstick"]["source"] = f"{p.aligned_dir}/{HELDOUT_FILE}"
    atomic_write_json(p.align_promotion, decision)
    print(f"promote_aligned: {decision['model_name']} v{decision['version']} — {decision['reason']}")
