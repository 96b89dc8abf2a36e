"""Reading params.yaml: the file and `--set key=value` overrides checked against the schema, every problem named by
its key (with the closest allowed key for a typo); and the schema as rows and as a default file, for the CLI."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from ultrathink.config.schema import Params


class ParamsError(ValueError):
    """A params file or override that the schema rejects; the message names the key and what is allowed."""


def _allowed_keys(model: type[BaseModel]) -> list[str]:
    return [f.alias or name for name, f in model.model_fields.items()]


def _section_model(loc: tuple) -> type[BaseModel]:
    """The pydantic model that owns the location `loc` (so a typo can be matched against its siblings)."""
    model: type[BaseModel] = Params
    for part in loc[:-1]:
        field = next((f for n, f in model.model_fields.items() if part in (n, f.alias)), None)
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            break
        model = field.annotation
    return model


def _describe(err: dict[str, Any]) -> str:
    loc = tuple(str(p) for p in err["loc"])
    key = ".".join(loc)
    if err["type"] == "extra_forbidden":
        allowed = _allowed_keys(_section_model(loc))
        close = difflib.get_close_matches(loc[-1], allowed, n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        return f"{key}: unknown key.{hint} Allowed: {', '.join(allowed)}"
    got = err.get("input")
    if isinstance(got, dict):  # a check across a whole section: its message already names the keys
        return f"{key}: {err['msg'].removeprefix('Value error, ')}"
    return f"{key}: {err['msg']} (got {got!r})"


def parse_override(item: str) -> tuple[list[str], Any]:
    """`train.lr=3e-4` → (['train', 'lr'], 0.0003). Values are YAML, as in `dvc exp run -S`."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ParamsError(f"override {item!r}: expected KEY=VALUE, e.g. train.lr=3e-4")
    return key.strip().split("."), yaml.safe_load(raw)


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for item in overrides:
        keys, value = parse_override(item)
        node = raw
        for part in keys[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ParamsError(f"override {item!r}: '{part}' is not a section")
        node[keys[-1]] = value
    return raw


def load_params(path: str | Path = "params.yaml", overrides: list[str] | None = None) -> Params:
    """Read and check params. Raises ParamsError with one line per problem, each naming its key."""
    path = Path(path)
    if not path.exists():
        raise ParamsError(f"{path}: params file not found")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ParamsError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise ParamsError(f"{path}: top level must be a mapping of sections, got {type(raw).__name__}")
    raw = apply_overrides(raw, overrides or [])
    try:
        return Params.model_validate(raw)
    except ValidationError as exc:
        lines = "\n".join(f"  - {_describe(e)}" for e in exc.errors())
        raise ParamsError(f"{path}: invalid params\n{lines}") from None


def schema_rows(model: type[BaseModel] = Params, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key, type, default, description) for every knob: the source for `ultrathink params`."""
    rows = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{field.alias or name}"
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows += schema_rows(ann, key + ".")
            continue
        default = field.get_default(call_default_factory=True)
        type_name = getattr(ann, "__name__", None) or str(ann).replace("typing.", "")
        rows.append((key, type_name, repr(default), field.description or ""))
    return rows


def default_params_yaml() -> str:
    """params.yaml content with every default, in schema order."""
    return yaml.safe_dump(Params().model_dump(by_alias=True), sort_keys=False)
