"""Score a text under a model named by a directory or an MLflow URI, with the one yardstick (ultrathink.scoring).

A model is named by either
  - a directory: a model dir (config.json + model.safetensors) whose tokenizer is the sibling `tokenizer/` dir (the
    pipeline's artifacts/model + artifacts/tokenizer layout), or a directory holding `model/` and `tokenizer/`;
  - an MLflow model URI (`models:/ultrathink@champion`, `models:/ultrathink/3`, `runs:/...`): the logged pyfunc's
    `model` and `tokenizer` artifacts, and the `ultrathink` package snapshot logged with it.

Models are scored on a device (`device`: "auto", the default, is the GPU when there is one; see
ultrathink.device.resolve_device), in this process or in the snapshot's.

A registered model is scored under its own code: a separate Python process puts the model's package snapshot first
on its path, so an edit of the model's math since it was registered (a sign in the rotary embedding, say) does not
change its score. Only the arithmetic of the yardstick (ultrathink/scoring.py, which imports nothing else of the
package) is today's, loaded by path.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ultrathink import scoring
from ultrathink.device import DeviceLike, resolve_device
from ultrathink.errors import StageError
from ultrathink.model import UltraThink
from ultrathink.scoring import TextScore
from ultrathink.tokenizer import load_tokenizer


@dataclass
class ModelFiles:
    model_dir: Path  # config.json + model.safetensors
    tokenizer_dir: Path
    code_dir: Path | None = None  # the package snapshot logged with a registered model (holds `ultrathink/`)


_SNAPSHOT_SCORER = """
import importlib.util, json, sys
code_dir, scoring_file, model_dir, tokenizer_dir, documents_file, function, device = sys.argv[1:8]
sys.path.insert(0, code_dir)
from ultrathink.model import UltraThink  # the model's own code
assert UltraThink.__module__.startswith("ultrathink.") and sys.modules["ultrathink"].__file__.startswith(code_dir)
spec = importlib.util.spec_from_file_location("ultrathink_yardstick", scoring_file)
scoring = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
spec.loader.exec_module(scoring)
from transformers import AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
with open(documents_file, encoding="utf-8") as f:
    documents = [json.loads(line)["item"] for line in f if line.strip()]
model = UltraThink.from_pretrained(model_dir).to(device)  # .to: a snapshot's from_pretrained may take no device
score = getattr(scoring, function)(model, tokenizer, documents)
print(json.dumps(score.to_dict()))
"""


def score_model(files: ModelFiles, documents, chats: bool = False, device: DeviceLike | None = None) -> TextScore:
    """Bits per byte of `documents` under a model and its own tokenizer, and under its own code when it has a
    snapshot (a registered model), else under this process's code (a model dir of this project). `chats`: the
    documents are chats (messages lists), scored on their answers only (scoring.score_conversations). `device`:
    where the model runs (None or "auto": the GPU when there is one); an unavailable one raises DeviceError."""
    function = "score_conversations" if chats else "score_documents"
    target = resolve_device(device)
    if files.code_dir is None:
        return getattr(scoring, function)(UltraThink.from_pretrained(files.model_dir, device=target),
                                          load_tokenizer(files.tokenizer_dir), documents)
    with tempfile.TemporaryDirectory(prefix="ultrathink-score-") as tmp:
        documents_file = Path(tmp) / "documents.jsonl"
        documents_file.write_text("".join(json.dumps({"item": d}) + "\n" for d in documents), encoding="utf-8")
        args = [sys.executable, "-c", _SNAPSHOT_SCORER, str(files.code_dir.resolve()), scoring.__file__,
                str(files.model_dir.resolve()), str(files.tokenizer_dir.resolve()), str(documents_file), function,
                str(target)]
        # Run from the temp dir so the project's own `ultrathink/` (the cwd) cannot shadow the snapshot.
        done = subprocess.run(args, cwd=tmp, capture_output=True, text=True)
    if done.returncode:
        raise StageError(f"scoring {files.model_dir} under its own code failed: {done.stderr.strip()[-800:]}")
    return TextScore(**json.loads(done.stdout.strip().splitlines()[-1]))
