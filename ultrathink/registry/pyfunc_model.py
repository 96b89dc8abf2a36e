"""The MLflow "models from code" definition of a logged UltraThink model.

MLflow logs this file's source instead of a cloudpickled object: loading a registered model runs this code and
then reads the weights with safetensors, so nothing is unpickled. Artifacts (set at log time by promote.py):
  model       the model dir written by `UltraThink.save_pretrained` (model.safetensors + config.json)
  tokenizer   the tokenizer dir readable by `ultrathink.tokenizer.load_tokenizer`
  generation  generation.json: default max_new_tokens, temperature, top_k, top_p and seed
The `ultrathink` package travels with the model as `code_paths`, so these imports work wherever it is loaded.

The device: `load_context` puts the model on the device named by the environment variable ULTRATHINK_DEVICE
("cpu", "cuda", "cuda:1", ...), or, unset or "auto", on the GPU when there is one, else the CPU
(ultrathink.device.resolve_device; an unavailable device fails the load with a message naming it). A predict call
can move it with the `device` param (`params={"device": "cpu"}`); "auto", the param's default, keeps it where it is.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import mlflow
import pandas as pd
from mlflow.pyfunc import PythonModel

from ultrathink.device import AUTO, resolve_device
from ultrathink.model.chat import is_chat_tokenizer, reply, user
from ultrathink.model import UltraThink
from ultrathink.model.generate import generate_text
from ultrathink.tokenizer import load_tokenizer

PROMPT_COLUMN = "prompt"
GENERATION_KEYS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed")
DEVICE_ENV = "ULTRATHINK_DEVICE"  # where load_context puts the model (default auto: the GPU when there is one)
DEVICE_PARAM = "device"  # a predict param that moves it ("auto": stay)


def to_prompts(model_input: Any) -> list[str]:
    """Accept what callers naturally send: a DataFrame with a `prompt` column, a list of str, or one str."""
    if isinstance(model_input, str):
        return [model_input]
    if isinstance(model_input, pd.DataFrame):
        column = PROMPT_COLUMN if PROMPT_COLUMN in model_input.columns else model_input.columns[0]
        return [str(p) for p in model_input[column].tolist()]
    if isinstance(model_input, (list, tuple)) and all(isinstance(p, str) for p in model_input):
        return list(model_input)
    raise TypeError(f"expected a DataFrame with a '{PROMPT_COLUMN}' column, a list of str or a str, "
                    f"got {type(model_input).__name__}")


class UltraThinkModel(PythonModel):
    """Text in, generated text out; generation knobs come from `params` over generation.json. A pretrained model
    continues each text; a fine-tuned one (its tokenizer has a chat template) answers each text as a user message.
    It runs on $ULTRATHINK_DEVICE (default auto), or on a predict call's `device` param when that is not auto."""

    def load_context(self, context) -> None:
        device = resolve_device(os.environ.get(DEVICE_ENV) or AUTO)
        self.model = UltraThink.from_pretrained(Path(context.artifacts["model"]), device=device)
        self.tokenizer = load_tokenizer(Path(context.artifacts["tokenizer"]))
        self.defaults = json.loads(Path(context.artifacts["generation"]).read_text())

    def generation_knobs(self, params: dict[str, Any] | None) -> dict[str, Any]:
        """generation.json defaults, overridden by any known key in `params` (unknown keys are ignored).
        top_k of 0 or None means no top-k cut, top_p of 1 or None no nucleus cut; temperature 0 means greedy."""
        knobs = {k: self.defaults.get(k) for k in GENERATION_KEYS}
        knobs.update({k: v for k, v in (params or {}).items() if k in GENERATION_KEYS})
        knobs["max_new_tokens"] = int(knobs["max_new_tokens"])
        knobs["temperature"] = float(knobs["temperature"])
        knobs["top_k"] = int(knobs["top_k"]) if knobs["top_k"] else None
        knobs["top_p"] = float(knobs["top_p"]) if knobs.get("top_p") is not None else None  # older models: none
        knobs["seed"] = int(knobs["seed"])
        return knobs

    def predict(self, context, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> list[str]:
        """One continuation per prompt. Through `mlflow.pyfunc` the signature turns a str or list of str into a
        one-column DataFrame first; called directly, a str or list of str works too. params' `device` (other than
        auto) moves the model there first, where it then stays."""
        knobs = self.generation_knobs(params)
        requested = (params or {}).get(DEVICE_PARAM)
        device = None if requested in (None, "", AUTO) else resolve_device(requested)
        if is_chat_tokenizer(self.tokenizer):
            return [reply(self.model, self.tokenizer, [user(prompt)], **knobs, device=device)
                    for prompt in to_prompts(model_input)]
        return [generate_text(self.model, self.tokenizer, prompt, **knobs, device=device)
                for prompt in to_prompts(model_input)]


mlflow.models.set_model(UltraThinkModel())
