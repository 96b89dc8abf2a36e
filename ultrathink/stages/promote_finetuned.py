"""promote_finetuned: register the fine-tuned model as a version of registry.finetuned_name (alias `challenger`)
and move its `champion` to it only when its answers score better than the champion's on the held-out chats it was
validated on (bits per answer byte, each model under its own chat tokenizer and code): the guarded promotion of the
pretrained models (ultrathink.registry), on another yardstick. Off (finetune.enabled false), it records that there
was nothing to promote."""

import json
from pathlib import Path

from ultrathink.config import Params
from ultrathink.config.fingerprint import section_hash
from ultrathink.finetune.outputs import HELDOUT_FILE, STATUS_FILE
from ultrathink.io import atomic_write_json



def run(params: Params) -> None:
    p = params.paths
    out = Path(p.finetuned_dir)
    status = json.loads((out / STATUS_FILE).read_text())
    if not status["enabled"]:
        atomic_write_json(p.finetune_promotion, {"promoted": False, "reason": "finetune.enabled is false: no "
                                                 "fine-tuned model"})
        print("promote_finetuned: nothing to promote (finetune.enabled: false)")
        return
    from ultrathink.evaluate import ChatYardstick
    from ultrathink.finetune.pairs import read_chats
    from ultrathink.finetune.sft import FINETUNE_CODE
    from ultrathink.lineage import code_hash, git_commit
    from ultrathink.registry.promote import promote
    from ultrathink.registry.tracking import load_run_id

    yardstick = ChatYardstick(tuple(tuple(chat) for chat in read_chats(out / HELDOUT_FILE)))
    tags = {"git_commit": git_commit(), "params_hash": section_hash(params, "finetune", "train"),
            "code_hash": code_hash(FINETUNE_CODE), "fingerprint": status["fingerprint"], **status["base"]}
    decision = promote(out / "model", out / "tokenizer", yardstick, params.registry, params.evaluate, tags,
                       load_run_id(out), Path("."), known_bpb=status["metrics"]["ft_response_bpb"],
                       name=params.registry.finetuned_name)
    decision["yardstick"]["source"] = f"{p.finetuned_dir}/{HELDOUT_FILE}"
    atomic_write_json(p.finetune_promotion, decision)
    print(f"promote_finetuned: {decision['model_name']} v{decision['version']} — {decision['reason']}")

