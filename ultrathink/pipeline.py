"""The pipeline's stage list, read from dvc.yaml: the one definition of the DAG, shared by the CLI and the flow."""

from __future__ import annotations

from graphlib import TopologicalSorter
from pathlib import Path

import yaml

DVC_FILE = "dvc.yaml"


def stage_order(root: str | Path = ".") -> list[str]:
    """Stage names of dvc.yaml in an order where every stage follows the stages whose outputs it reads."""
    stages = yaml.safe_load((Path(root) / DVC_FILE).read_text())["stages"]
    producers = {}
    for name, stage in stages.items():
        for out in stage.get("outs", []) + stage.get("metrics", []) + stage.get("plots", []):
            producers[_path(out)] = name
    graph = {name: set() for name in stages}
    for name, stage in stages.items():
        for dep in stage.get("deps", []):
            dep = _path(dep)
            graph[name] |= {p for out, p in producers.items() if p != name and _within(dep, out)}
    return list(TopologicalSorter(graph).static_order())


def _path(entry) -> str:
    """An out/dep entry is a string or a one-key mapping {path: options}."""
    return (next(iter(entry)) if isinstance(entry, dict) else entry).rstrip("/")


def _within(dep: str, out: str) -> bool:
    return dep == out or dep.startswith(out + "/") or out.startswith(dep + "/")
