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
from ultrathink.scoring import PreferenceScore, TextScore
from ultrathink.tokenizer import load_tokenizer


@dataclass
class ModelFiles:
    model_dir: Path  # config.json + model.safetensors
    tokenizer_dir: Path
    code_dir: Path | None = None  # the package snapshot logged with a registered model (holds `ultrathink/`)


_SNAPSHOT_RUNNER = """
import importlib.util, json, sys
code_dir, request_file = sys.argv[1:3]
sys.path.insert(0, code_dir)
from ultrathink.model import UltraThink  # the model's own code
assert UltraThink.__module__.startswith("ultrathink.") and sys.modules["ultrathink"].__file__.startswith(code_dir)
with open(request_file, encoding="utf-8") as f:
    request = json.load(f)
spec = importlib.util.spec_from_file_location(request["module_name"], request["module_file"])
module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
spec.loader.exec_module(module)
from transformers import AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained(request["tokenizer_dir"], local_files_only=True)
model = UltraThink.from_pretrained(request["model_dir"]).to(request["device"])  # a snapshot's may take no device
result = getattr(module, request["function"])(model, tokenizer, **request["kwargs"])
with open(request["result_file"], "w", encoding="utf-8") as f:
    json.dump(result.to_dict() if hasattr(result, "to_dict") else result, f)
"""


def run_under_model_code(files: ModelFiles, module, function: str, kwargs: dict, device: DeviceLike | None = None,
                         what: str = "scoring") -> dict:
    """`module.function(model, tokenizer, **kwargs)` (JSON in, JSON out) in a separate Python process whose
    `ultrathink` package is the registered model's snapshot (files.code_dir); `module` is today's, loaded by path,
    and imports nothing of the package (ultrathink/scoring.py, ultrathink/harness.py). A failure raises StageError
    with the end of the process's stderr."""
    with tempfile.TemporaryDirectory(prefix="ultrathink-score-") as tmp:
        request = {"module_name": f"ultrathink_today_{Path(module.__file__).stem}", "module_file": module.__file__,
                   "function": function, "kwargs": kwargs, "model_dir": str(files.model_dir.resolve()),
                   "tokenizer_dir": str(files.tokenizer_dir.resolve()), "device": str(resolve_device(device)),
                   "result_file": str(Path(tmp) / "result.json")}
        (Path(tmp) / "request.json").write_text(json.dumps(request), encoding="utf-8")
        # -P: the working directory (the project, whose own `ultrathink/` would shadow the snapshot) is not put on
        # the path; it stays the working directory, so relative paths (task data files) mean what they say.
        args = [sys.executable, "-P", "-c", _SNAPSHOT_RUNNER, str(files.code_dir.resolve()),
                str(Path(tmp) / "request.json")]
        done = subprocess.run(args, capture_output=True, text=True)
        if done.returncode:
            raise StageError(f"{what} {files.model_dir} under its own code failed: {done.stderr.strip()[-800:]}")
        return json.loads(Path(request["result_file"]).read_text(encoding="utf-8"))


def score_model(files: ModelFiles, documents, chats: bool = False, device: DeviceLike | None = None) -> TextScore:
    """Bits per byte of `documents` under a model and its own tokenizer, and under its own code when it has a
    snapshot (a registered model), else under this process's code (a model dir of this project). `chats`: the
    documents are chats (messages lists), scored on their answers only (scoring.score_conversations). `device`:
    where the model runs (None or "auto": the GPU when there is one); an unavailable one raises DeviceError."""
    function = "score_conversations" if chats else "score_documents"
    if files.code_dir is None:
        return getattr(scoring, function)(UltraThink.from_pretrained(files.model_dir, device=resolve_device(device)),
                                          load_tokenizer(files.tokenizer_dir), documents)
    texts = {("conversations" if chats else "documents"): list(documents)}  # the function's parameter
    return TextScore(**run_under_model_code(files, scoring, function, texts, device))


def score_pairs(files: ModelFiles, pairs, device: DeviceLike | None = None) -> PreferenceScore:
    """How a model's own likelihoods rank preference pairs (scoring.score_preferences), under its own code when it
    has a snapshot (a registered model), else under this process's."""
    if files.code_dir is None:
        return scoring.score_preferences(UltraThink.from_pretrained(files.model_dir, device=resolve_device(device)),
                                         load_tokenizer(files.tokenizer_dir), list(pairs))
    return PreferenceScore(**run_under_model_code(files, scoring, "score_preferences", {"pairs": list(pairs)}, device))
