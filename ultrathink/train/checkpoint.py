"""Checkpoints that survive a crash mid-write and never unpickle arbitrary objects.

A checkpoint is a directory `step_00000100/` holding
  model.safetensors + config.json   the weights (safetensors: no pickle),
  state.pt                          optimizer, scheduler, RNG states, loader position, history: tensors and plain
                                    containers only, read back with torch.load(weights_only=True),
  deepspeed/                        (backend deepspeed) every rank's shard of the optimizer state, DeepSpeed's format,
  manifest.json                     step, config fingerprint and the sha256 of every file above.
It is written under a temporary name and renamed into place, so a process killed mid-write leaves no directory that
looks complete; on load, a checkpoint whose files do not match its manifest is skipped with a warning. With several
processes, every rank writes its shards into the same temporary directory (a shared filesystem across nodes) and
the main rank alone writes the rest, the manifest and the rename.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from ultrathink.model.model import WEIGHTS_FILE
from ultrathink.train.distributed import Distributed

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
STATE_FILE = "state.pt"
SHARDS_DIR = "deepspeed"
BEST = "best"
PARTIAL = ".partial"  # suffix of a checkpoint being written
_STEP_DIR = re.compile(r"^step_(\d{8})$")


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass
class Checkpoint:
    path: Path
    step: int
    fingerprint: str

    def load_state(self) -> dict[str, Any]:
        return torch.load(self.path / STATE_FILE, map_location="cpu", weights_only=True)

    def load_weights(self) -> dict[str, torch.Tensor]:
        return load_file(self.path / WEIGHTS_FILE)


class CheckpointManager:
    def __init__(self, directory: str | Path, keep: int):
        self.directory, self.keep = Path(directory), keep

    def save(self, step: int, fingerprint: str, model, state: dict[str, Any], name: str | None = None,
             weights: dict[str, torch.Tensor] | None = None, shards: Callable[[Path], None] | None = None,
             dist: Distributed | None = None) -> Path:
        """Write `step_<step>/` (or `name/`, e.g. the best checkpoint, kept apart from the last N). `weights`:
        the full state dict when the model itself holds only a shard. `shards(dir)`: called on every rank to
        write its part of the state into `dir` (collective); all ranks must call save."""
        dist = dist or Distributed()
        final = self.directory / (name or f"step_{step:08d}")
        tmp = self.directory / f".{final.name}{PARTIAL}"  # one name that every rank agrees on
        if dist.is_main:
            weights = weights if weights is not None else model.state_dict()
            bad = [n for n, p in weights.items() if p.is_floating_point() and not torch.isfinite(p).all()]
            if bad:
                raise ValueError(f"refusing to checkpoint non-finite weights ({', '.join(bad[:3])})")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        try:
            if shards is not None:
                shards(tmp / SHARDS_DIR)
                dist.barrier()
            if dist.is_main:
                self._commit(tmp, final, step, fingerprint, model, state, weights)
        except BaseException:
            if dist.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        dist.barrier()
        return final

    def _commit(self, tmp: Path, final: Path, step: int, fingerprint: str, model, state: dict[str, Any],
                weights: dict[str, torch.Tensor] | None) -> None:
        model.save_pretrained(tmp, weights)
        torch.save(state, tmp / STATE_FILE)
        files = {str(p.relative_to(tmp)): sha256(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
        manifest = {"step": step, "fingerprint": fingerprint, "files": files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        _fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        self._prune()

    def _step_dirs(self) -> list[tuple[int, Path]]:
        if not self.directory.exists():
            return []
        found = [(int(m.group(1)), p) for p in self.directory.iterdir() if (m := _STEP_DIR.match(p.name))]
        return sorted(found, reverse=True)

    def _prune(self) -> None:
        for _, path in self._step_dirs()[self.keep :]:
            shutil.rmtree(path, ignore_errors=True)
        for leftover in self.directory.glob(f".*{PARTIAL}"):  # temp dirs of writes that were killed
            shutil.rmtree(leftover, ignore_errors=True)

    def latest(self) -> Checkpoint | None:
        """The newest checkpoint whose files match its manifest; corrupt ones are reported and skipped."""
        for step, path in self._step_dirs():
            problem = _verify(path)
            if problem is None:
                manifest = json.loads((path / MANIFEST).read_text())
                return Checkpoint(path, step, manifest["fingerprint"])
            log.warning("checkpoint %s is unusable (%s); falling back to an older one", path, problem)
        return None

    def best(self) -> Checkpoint | None:
        path = self.directory / BEST
        if not path.exists() or _verify(path) is not None:
            return None
        manifest = json.loads((path / MANIFEST).read_text())
        return Checkpoint(path, manifest["step"], manifest["fingerprint"])

    def clear(self) -> None:
        for _, path in self._step_dirs():
            shutil.rmtree(path)
        shutil.rmtree(self.directory / BEST, ignore_errors=True)


def _verify(path: Path) -> str | None:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        return f"manifest unreadable: {exc}"
    for name, digest in manifest["files"].items():
        file = path / name
        if not file.exists():
            return f"{name} missing"
        if sha256(file) != digest:
            return f"{name} fails its checksum"
    return None


def _fsync_dir(path: Path) -> None:
    """Flush file contents before the rename makes the checkpoint visible."""
    for p in path.rglob("*"):
        if not p.is_file():
            continue
        with open(p, "rb") as f:
            os.fsync(f.fileno())
