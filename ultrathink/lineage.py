"""Where a model came from: git commit, params hash, data hash, code hash — tags on runs and registered versions,
and the parts of a checkpoint's fingerprint."""

from __future__ import annotations

import hashlib
import importlib.util
import subprocess
from pathlib import Path

from ultrathink.config import Params
from ultrathink.train.checkpoint import sha256

# The code that determines the weights a training run computes: the train stage's code dependencies in dvc.yaml
# (a test keeps the two lists equal). config.py belongs here: it derives `hidden` and `head_dim`; scoring.py computes
# the validation loss that picks the best checkpoint.
TRAINING_CODE = ("tasks.train", "ultrathink.config", "ultrathink.model", "ultrathink.scoring", "ultrathink.train")


def git_commit(root: str | Path = ".") -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def directory_hash(directory: str | Path) -> str:
    """sha256 over the names and contents of the files in a directory, in sorted order."""
    digest = hashlib.sha256()
    for path in sorted(p for p in Path(directory).rglob("*") if p.is_file()):
        digest.update(f"{path.relative_to(directory)}\0{sha256(path)}\n".encode())
    return digest.hexdigest()[:16]


def module_files(name: str) -> list[tuple[str, Path]]:
    """(name relative to the module, path) of a module's source file, or of every .py file in a package."""
    spec = importlib.util.find_spec(name)
    if spec is None:
        raise ModuleNotFoundError(f"training code module {name!r} not found")
    if spec.submodule_search_locations:  # a package: all of its .py files, bytecode caches excluded
        base = Path(next(iter(spec.submodule_search_locations)))
        return [(f"{name}/{p.relative_to(base)}", p) for p in sorted(base.rglob("*.py"))]
    return [(name, Path(spec.origin))]


def code_hash(modules: tuple[str, ...] = TRAINING_CODE) -> str:
    """sha256 of the training code's source files: a change of one line of the model's math changes it."""
    digest = hashlib.sha256()
    for name in modules:
        for relative, path in module_files(name):
            digest.update(f"{relative}\0{sha256(path)}\n".encode())
    return digest.hexdigest()[:16]


def lineage_tags(params: Params, root: str | Path = ".") -> dict[str, str]:
    return {
        "git_commit": git_commit(root),
        "params_hash": params.params_hash(),
        "data_hash": directory_hash(Path(root) / params.paths.prepared_dir),
        "code_hash": code_hash(),
    }
