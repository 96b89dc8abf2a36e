"""The project's recipes for naming things by their content, in one place: a value (sha256 of its canonical JSON), a
file (sha256 of its bytes), a set of files (sha256 over their relative names and file hashes)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterable


def json_hash(value) -> str:
    """sha256 of `value`'s canonical JSON (sorted keys), first 16 hex digits."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def file_sha256(path: str | Path) -> str:
    """sha256 of a file's bytes (full hex digest), read a MiB at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def files_hash(root: str | Path, relatives: Iterable[str | Path]) -> str:
    """sha256 over the names (relative to `root`) and contents of the given files, in the order given; 16 digits."""
    digest = hashlib.sha256()
    for relative in relatives:
        digest.update(f"{relative}\0{file_sha256(Path(root) / relative)}\n".encode())
    return digest.hexdigest()[:16]


def directory_hash(directory: str | Path) -> str:
    """files_hash of every file under `directory`, in sorted order."""
    directory = Path(directory)
    return files_hash(directory, sorted(p.relative_to(directory) for p in directory.rglob("*") if p.is_file()))
