"""Where a model came from: git commit, params hash, data hash — tags on the registered model version."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

from ultrathink.config import Params
from ultrathink.train.checkpoint import sha256


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


def lineage_tags(params: Params, root: str | Path = ".") -> dict[str, str]:
    return {
        "git_commit": git_commit(root),
        "params_hash": params.params_hash(),
        "data_hash": directory_hash(Path(root) / params.paths.prepared_dir),
    }
