"""Where a model came from: git commit, params hash, data hash, code hash — tags on runs and registered versions,
and the parts of a checkpoint's fingerprint."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import yaml

from ultrathink.config import Params
from ultrathink.config.fingerprint import params_hash
from ultrathink.hashing import directory_hash, files_hash

# The project's own packages: the module closure of a stage follows imports into these and no others.
PROJECT_PACKAGES = ("ultrathink", "tasks")
PROJECT_ROOT = Path(__file__).resolve().parents[1]
# The stage whose module closure is the code that determines a pretrained model's weights.
TRAINING_CODE = "ultrathink.stages.train"
LINEAGE_FILE = "lineage.json"  # in a model dir: tokenizer hash, fingerprint and parent of the run that wrote it


def git_commit(root: str | Path = ".") -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def module_source(name: str, root: Path) -> Path | None:
    base = root.joinpath(*name.split("."))
    for path in (base / "__init__.py", base.with_suffix(".py")):
        if path.is_file():
            return path
    return None


def imported_names(name: str, path: Path):
    """The names a module imports anywhere in its source (function-level imports too): `a.b`, and `a.b.c` for
    `from a.b import c` (c may be a submodule)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join(parts + ([node.module] if node.module else []))
            yield module
            yield from (f"{module}.{alias.name}" for alias in node.names)


# Folders beside a module that hold files it reads as part of its code: `csrc/<module>.*`, the C++ it builds and
# runs (cpu_kernels.py's), and `assets/<module>.*`, the data it ships (reference.py's snapshot of a corpus).
COMPANION_FOLDERS = ("csrc", "assets")


def companion_files(path: Path) -> list[Path]:
    """The files the module at `path` reads as part of its code (COMPANION_FOLDERS)."""
    return sorted(p for folder in COMPANION_FOLDERS for p in (path.parent / folder).glob(f"{path.stem}.*")
                  if p.is_file())


def module_closure(entry: str, root: Path = PROJECT_ROOT) -> list[Path]:
    """The source files a `python -m <entry>` process can execute from this project: the entry module and every
    project module it imports, transitively (the packages' __init__ files included), and the files those modules read
    as part of their code (`companion_files`), as paths relative to root."""
    found, pending = {}, [entry]
    while pending:
        name = pending.pop()
        if name.split(".")[0] not in PROJECT_PACKAGES:
            continue
        parts = name.split(".")
        for depth in range(1, len(parts) + 1):
            module = ".".join(parts[:depth])
            if module not in found and (path := module_source(module, root)) is not None:
                found[module] = path
                pending.extend(imported_names(module, path))
    if entry not in found:
        raise ModuleNotFoundError(f"{entry}: no such module under {root}")
    paths = {file for path in found.values() for file in companion_files(path)} | set(found.values())
    return sorted(path.relative_to(root) for path in paths)


def undeclared_code(entry: str, root: Path = PROJECT_ROOT) -> dict[str, list[str]]:
    """For each stage of root's dvc.yaml whose command is `python -m <entry>`: the files that process runs (its
    module closure) which the stage's deps name neither themselves nor by a folder above them. DVC re-runs a stage
    only when a dep changes, so an edit of one of these would leave the stage's outputs up to date in its eyes.
    Empty when there is no dvc.yaml or no such stage."""
    dvc_yaml = root / "dvc.yaml"
    if not dvc_yaml.is_file():
        return {}
    stages = (yaml.safe_load(dvc_yaml.read_text()) or {}).get("stages") or {}
    runs_entry = {name: stage for name, stage in stages.items()
                  if isinstance(stage.get("cmd"), str) and stage["cmd"].split()[:3] == ["python", "-m", entry]}
    if not runs_entry:
        return {}
    closure, undeclared = module_closure(entry, root), {}
    for name, stage in runs_entry.items():
        deps = [Path(dep if isinstance(dep, str) else next(iter(dep))) for dep in stage.get("deps") or []]
        if missing := [str(path) for path in closure if not any(dep == path or dep in path.parents for dep in deps)]:
            undeclared[name] = missing
    return undeclared


def code_hash(entry: str = TRAINING_CODE, root: Path = PROJECT_ROOT) -> str:
    """sha256 of the source files in `entry`'s module closure: a change of one line of any code the stage runs
    changes it."""
    return files_hash(root, module_closure(entry, root))


def lineage_tags(params: Params, root: str | Path = ".") -> dict[str, str]:
    return {
        "git_commit": git_commit(root),
        "params_hash": params_hash(params),
        "data_hash": directory_hash(Path(root) / params.paths.prepared_dir),
        "code_hash": code_hash(),
    }
