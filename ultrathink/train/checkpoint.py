"""Checkpoints that survive a crash mid-write, never unpickle arbitrary objects, and are never lost to another run.

Each configuration keeps its own folder, `<checkpoint_dir>/<fingerprint>/`, where the fingerprint hashes everything
that determines the weights: the params that are not bookkeeping, the packed data, the training code and the warm
start's parent weights. A run resumes only from its own folder; going back to an earlier configuration (git checkout,
`dvc exp apply`) finds that configuration's folder where it was left. `fingerprint.json` in each folder names its
parts and when it was last used; the least recently used folders beyond `train.keep_configs` are removed, never the
one in use.

A checkpoint is a directory `step_00000100/` (or `best/`) in that folder, holding
  model.safetensors + config.json   the weights (safetensors: no pickle); under FSDP written from the ranks' shards,
  state.pt                          scheduler, RNG states, loader position, history, the optimizers' param groups:
                                    tensors and plain containers only, read back with torch.load(weights_only=True),
  optimizer/                        (torch engines) the optimizer state keyed by parameter name, one safetensors file
                                    per rank with its own shards (sharded.py): resumable on any number of ranks,
  deepspeed/                        (backend deepspeed) every rank's shard of the optimizer state, DeepSpeed's format,
  manifest.json                     step, config fingerprint, the ranks that wrote it, the sha256 of every file above.
It is written under a temporary name and renamed into place, so a process killed mid-write leaves no directory that
looks complete; on load, a checkpoint whose files do not match its manifest is skipped with a warning. With several
processes, every rank writes its shards into the same temporary directory (a shared filesystem across nodes) and
the main rank alone writes the rest, the manifest and the rename.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from ultrathink.hashing import file_sha256, json_hash
from ultrathink.model.model import WEIGHTS_FILE
from ultrathink.train.distributed import Distributed

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FINGERPRINT_FILE = "fingerprint.json"
STATE_FILE = "state.pt"
BEST = "best"
PARTIAL = ".partial"  # suffix of a checkpoint being written
REPLACED = ".replaced"  # suffix of a checkpoint being replaced by a newer one of the same name (best/)
_STEP_DIR = re.compile(r"^step_(\d{8})$")


@dataclass(frozen=True)
class Fingerprint:
    """What determines the weights a run computes; a checkpoint is resumed only by the same fingerprint."""

    params: str  # config.fingerprint: the weight-determining knobs, bookkeeping excluded
    data: str  # hash of the packed token files (and so of the tokenizer)
    code: str  # hash of the code the train stage runs (lineage.code_hash: its module closure)
    parent: str = "none"  # sha256 of the warm start's weights
    plan: str = "none"  # hash of the plan's decisions (precision, attention kernel, compile, shape: plan.py)

    @property
    def id(self) -> str:
        return json_hash(asdict(self))

    def differences(self, other: dict) -> list[str]:
        """Names of the parts where `other` (a fingerprint.json's parts) differs: e.g. ['code', 'params']."""
        return [f.name for f in fields(self) if other.get(f.name) != getattr(self, f.name)]


@dataclass
class Checkpoint:
    path: Path
    step: int
    fingerprint: str
    manifest: dict

    def load_state(self) -> dict[str, Any]:
        return torch.load(self.path / STATE_FILE, map_location="cpu", weights_only=True)

    def load_weights(self) -> dict[str, torch.Tensor]:
        return load_file(self.path / WEIGHTS_FILE)


@dataclass
class ConfigFolder:
    """The checkpoint folder of one configuration, as found on disk."""

    path: Path
    parts: dict
    last_used: float


class CheckpointManager:
    """The checkpoints of one configuration (`root/<fingerprint.id>/`), beside those of others under `root`."""

    def __init__(self, root: str | Path, fingerprint: Fingerprint, keep: int, keep_configs: int = 5,
                 extra: dict | None = None):
        self.root, self.fingerprint, self.keep, self.keep_configs = Path(root), fingerprint, keep, keep_configs
        self.directory = self.root / fingerprint.id
        self.extra = extra or {}  # recorded in every manifest (e.g. the tokenizer's hash, the optimizer)

    def save(self, step: int, model, state: dict[str, Any], name: str | None = None,
             weights: dict[str, torch.Tensor] | None = None, shards: Callable[[Path], None] | None = None,
             dist: Distributed | None = None, weights_in_shards: bool = False) -> Path:
        """Write `step_<step>/` (or `name/`, e.g. the best checkpoint, kept apart from the last N). `weights`:
        the full state dict when the model itself holds only a shard. `shards(dir)`: called on every rank to
        write its part of the state into the checkpoint's directory (collective), and with `weights_in_shards`
        that includes model.safetensors; all ranks must call save."""
        dist = dist or Distributed()
        final = self.directory / (name or f"step_{step:08d}")
        tmp = self.directory / f".{final.name}{PARTIAL}"  # one name that every rank agrees on
        if dist.is_main:
            if not weights_in_shards:
                weights = weights if weights is not None else model.state_dict()
                bad = [n for n, p in weights.items() if p.is_floating_point() and not torch.isfinite(p).all()]
                if bad:
                    raise ValueError(f"refusing to checkpoint non-finite weights ({', '.join(bad[:3])})")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        try:
            if shards is not None:
                shards(tmp)
                dist.barrier()
            if dist.is_main:
                ranks = {"world_size": dist.world_size, "backend": dist.backend}
                self._commit(tmp, final, step, model, state, None if weights_in_shards else weights, ranks)
        except BaseException:
            if dist.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        dist.barrier()
        return final

    def _commit(self, tmp: Path, final: Path, step: int, model, state: dict[str, Any],
                weights: dict[str, torch.Tensor] | None, ranks: dict) -> None:
        if weights is None:  # model.safetensors is already there, written from the shards
            model.save_config(tmp)
        else:
            model.save_pretrained(tmp, weights)
        torch.save(state, tmp / STATE_FILE)
        files = {str(p.relative_to(tmp)): file_sha256(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
        manifest = {"step": step, "fingerprint": self.fingerprint.id, "parts": asdict(self.fingerprint), **self.extra,
                    **ranks, "files": files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        self._publish(tmp, final)

    def save_as(self, checkpoint: Path, dist: Distributed | None = None) -> Path:
        """`checkpoint` (best/, just written) as its step's checkpoint too, `step_<step>/`: its files hard-linked, not
        written again (copied where the filesystem cannot link them). The periodic checkpoint of a step whose
        validation improved is the best one just saved (Trainer.fit); written again, the two took 3.97 s for an
        88M-parameter model where linking takes them to 1.54 (benchmarks/checkpoint_seconds.py). Replacing either
        name later never touches the other: a checkpoint's files are always written anew, never changed in place.
        All ranks must call it."""
        dist = dist or Distributed()
        step = json.loads((Path(checkpoint) / MANIFEST).read_text())["step"]
        final = self.directory / f"step_{step:08d}"
        if dist.is_main:
            tmp = self.directory / f".{final.name}{PARTIAL}"
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                shutil.copytree(checkpoint, tmp, copy_function=_link_or_copy)
                self._publish(tmp, final)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        dist.barrier()
        return final

    def _publish(self, tmp: Path, final: Path) -> None:
        """Put the complete checkpoint `tmp` in place as `final` (replacing one of that name), then prune."""
        _fsync_dir(tmp)
        replaced = _replaced(final)
        if final.exists():  # best/ again: the old one stays, renamed, until the new one is in place
            shutil.rmtree(replaced, ignore_errors=True)
            os.replace(final, replaced)
        os.replace(tmp, final)
        shutil.rmtree(replaced, ignore_errors=True)
        self.mark_used()
        self._prune()
        self._prune_configs()

    def mark_used(self) -> None:
        """Record this configuration's parts and the time, which orders folders for `train.keep_configs`."""
        self.directory.mkdir(parents=True, exist_ok=True)
        record = {"fingerprint": self.fingerprint.id, "parts": asdict(self.fingerprint), "last_used": time.time()}
        tmp = self.directory / f".{FINGERPRINT_FILE}{PARTIAL}"
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        os.replace(tmp, self.directory / FINGERPRINT_FILE)

    def others(self) -> list[ConfigFolder]:
        """Checkpoint folders of other configurations, most recently used first."""
        found = []
        for path in self.root.iterdir() if self.root.is_dir() else []:
            record = path / FINGERPRINT_FILE
            if path == self.directory or not record.is_file():
                continue
            try:
                data = json.loads(record.read_text())
                found.append(ConfigFolder(path, data.get("parts", {}), float(data.get("last_used", 0))))
            except (OSError, ValueError):
                continue  # a folder being written by another process, or not ours
        return sorted(found, key=lambda f: f.last_used, reverse=True)

    def _prune_configs(self) -> None:
        for folder in self.others()[self.keep_configs - 1 :]:
            log.warning("removing checkpoint folder %s: least recently used beyond train.keep_configs=%d",
                        folder.path, self.keep_configs)
            shutil.rmtree(folder.path, ignore_errors=True)

    def set_aside(self) -> Path | None:
        """Move this configuration's checkpoints to `<id>.set-aside-<time>` (kept, not resumed): a fresh start
        (train.resume: false) must not later resume from a mix of the old run's and the new run's steps."""
        if not self.directory.exists():
            return None
        aside = self.root / f"{self.fingerprint.id}.set-aside-{time.strftime('%Y%m%dT%H%M%S')}"
        os.replace(self.directory, aside)
        record = aside / FINGERPRINT_FILE
        if record.is_file():  # an ordinary folder of another configuration from now on (counted by keep_configs)
            data = json.loads(record.read_text())
            data["parts"] = {**data.get("parts", {}), "set_aside": aside.name}
            record.write_text(json.dumps(data, indent=2) + "\n")
        return aside

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
        for old in self.directory.glob(f".*{REPLACED}"):  # killed after its successor was in place: not needed
            if (self.directory / old.name[1 : -len(REPLACED)]).exists():
                shutil.rmtree(old, ignore_errors=True)

    def remove_after(self, step: int) -> None:
        """Remove this configuration's checkpoints of steps after `step`: a run that went back to `step`
        (train.decay_patience) must resume on the path it took from there, not on the one it left."""
        for later, path in self._step_dirs():
            if later > step:
                shutil.rmtree(path, ignore_errors=True)

    def latest(self) -> Checkpoint | None:
        """The newest checkpoint whose files match its manifest; corrupt ones are reported and skipped."""
        for step, path in self._step_dirs():
            problem = _verify(path)
            if problem is None:
                return _checkpoint(path)
            log.warning("checkpoint %s is unusable (%s); falling back to an older one", path, problem)
        return None

    def best(self) -> Checkpoint | None:
        """The checkpoint with the lowest validation loss so far. A run killed while replacing it left the
        previous best under its replaced name: that one is put back. An unusable best is reported, not hidden."""
        path, replaced = self.directory / BEST, _replaced(self.directory / BEST)
        if not path.exists() and replaced.exists():
            os.replace(replaced, path)
            log.warning("%s was being replaced when a run stopped: the previous best is restored", path)
        if not path.exists():
            return None
        problem = _verify(path)
        if problem is not None:
            log.warning("the best checkpoint %s is unusable (%s): it is not selected", path, problem)
            return None
        return _checkpoint(path)


def _replaced(path: Path) -> Path:
    return path.parent / f".{path.name}{REPLACED}"


def is_checkpoint(path: Path) -> bool:
    return (Path(path) / MANIFEST).is_file() and (Path(path) / STATE_FILE).is_file()


def read_checkpoint(path: Path) -> Checkpoint:
    """A checkpoint directory, verified against its manifest (ValueError naming the problem otherwise)."""
    path = Path(path)
    problem = _verify(path)
    if problem is not None:
        raise ValueError(f"checkpoint {path} is unusable: {problem}")
    return _checkpoint(path)


def _checkpoint(path: Path) -> Checkpoint:
    manifest = json.loads((path / MANIFEST).read_text())
    return Checkpoint(path, manifest["step"], manifest["fingerprint"], manifest)


def _verify(path: Path) -> str | None:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        return f"manifest unreadable: {exc}"
    for name, digest in manifest["files"].items():
        file = path / name
        if not file.exists():
            return f"{name} missing"
        if file_sha256(file) != digest:
            return f"{name} fails its checksum"
    return None


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:  # a filesystem without hard links, or across devices
        shutil.copy2(source, target)


def _fsync_dir(path: Path) -> None:
    """Flush file contents before the rename makes the checkpoint visible."""
    for p in path.rglob("*"):
        if not p.is_file():
            continue
        with open(p, "rb") as f:
            os.fsync(f.fileno())
