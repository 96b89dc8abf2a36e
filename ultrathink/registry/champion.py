"""Who is champion, and every move of the alias: guarded by one yardstick, serialised, recorded, reversible.

- One yardstick: two versions are compared only by their bits per byte on the same text (a version's validation
  text, logged with it as `yardstick/yardstick.jsonl`), each under its own tokenizer (ultrathink.evaluate); for
  fine-tuned models the text is held-out chats, scored on the answers only.
- Compare-and-set: a decision and the alias move it leads to happen under one lock (a file beside the SQLite store,
  so every process on this machine that promotes into that store takes turns), and the champion is re-read right
  before the move; if it changed meanwhile, the decision is taken again against the new champion.
- Every move is recorded: the version gets `champion_at`, `champion_by` and `champion_why` tags, and the
  registered model's `champion_history` tag lists the champions in order, which `rollback` walks back.
"""

from __future__ import annotations

import getpass
import logging
import math
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlflow
from filelock import FileLock
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from ultrathink.downstream import METRIC_PREFIX
from ultrathink.errors import StageError
from ultrathink.evaluate import Yardstick, read_yardstick
from ultrathink.registry.tracking import BAD_VALUE, NOT_FOUND, sqlite_path
from ultrathink.registry.models import resolve_model_files

log = logging.getLogger(__name__)

CHAMPION = "champion"
CHALLENGER = "challenger"
HISTORY_TAG = "champion_history"  # registered-model tag: versions that became champion, oldest first
YARDSTICK_ARTIFACT = "yardstick/yardstick.jsonl"  # in a version's run: the text its val_bpb was measured on
LOCK_WAIT_SECONDS = 1800
# Relative margin a challenger must win by. The same weights retrained bit for bit score the same up to float
# summation order (the stage and the scorer batch windows differently): ~4e-8 measured; such a tie keeps the champion.
TIE_TOLERANCE = 1e-6
_MAX_RETRIES = 5
_HISTORY_KEEP = 200  # entries of champion_history kept (a tag value is limited in size)


class RegistryError(StageError):
    """A registry command cannot do what it was asked; the message says why and what to do."""


@dataclass
class Decision:
    promoted: bool
    reason: str
    champion_version: int | None  # the champion the challenger was compared with (None: there was none)
    champion_bpb: float | None  # its score on the yardstick (None: none, or it could not be scored)
    task_guard: dict | None = None  # the task guard's checks (downstream.check_guard), when it ran


# A second opinion on a challenger that beat the champion on the yardstick: given the champion's version number,
# {"passed": bool, "reason": str, ...} (downstream.check_guard's record); an exception keeps the champion.
Guard = Callable[[int], dict]


def actor() -> str:
    try:
        return f"{getpass.getuser()}@{socket.gethostname()}"
    except (KeyError, OSError):
        return socket.gethostname()


def lock_path(tracking_uri: str, root: Path) -> Path:
    """The file that serialises champion moves: beside a SQLite store, else in the project (a remote server's
    clients on other machines are then ordered only by the re-read before each move)."""
    db = sqlite_path(tracking_uri)
    return Path(f"{db}.champion.lock") if db else Path(root).resolve() / ".ultrathink" / "champion.lock"


def champion_lock(root: Path) -> FileLock:
    path = lock_path(mlflow.get_tracking_uri(), root)
    path.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(str(path), timeout=LOCK_WAIT_SECONDS)


def current_champion(client: MlflowClient, name: str) -> ModelVersion | None:
    """The champion version, or None if there is none yet. A store failure raises rather than reading as
    "no champion", which would promote the new model unchecked."""
    try:
        return client.get_model_version_by_alias(name, CHAMPION)
    except MlflowException as exc:
        if exc.error_code in (NOT_FOUND, BAD_VALUE):
            return None
        raise


def score_version(name: str, version: int, yardstick: Yardstick) -> float:
    """Bits per byte of a registered version on `yardstick`, under the version's own tokenizer and own code."""

    return yardstick.score(resolve_model_files(f"models:/{name}/{version}"))


def version_yardstick(version: ModelVersion) -> Yardstick:
    """The text a version was measured on, from its run's artifacts."""
    try:
        local = mlflow.artifacts.download_artifacts(run_id=version.run_id, artifact_path=YARDSTICK_ARTIFACT)
    except (MlflowException, OSError) as exc:
        raise RegistryError(f"version {version.version} has no yardstick text ({YARDSTICK_ARTIFACT} in run "
                            f"{version.run_id}): {exc}") from None
    return read_yardstick(Path(local).read_text(encoding="utf-8"))


def judge(version: int, bpb: float, champion: ModelVersion | None, score: Callable[[int], float]) -> Decision:
    """Should `version` (its bpb on a yardstick) take over from `champion`? `score(v)` scores a version on the same
    text; if the champion cannot be scored, it is kept and the decision says why."""
    if not math.isfinite(bpb):
        return Decision(False, f"val_bpb={bpb} is not finite", _number(champion), None)
    if champion is None:
        return Decision(True, "no champion yet", None, None)
    theirs = int(champion.version)
    if theirs == version:
        return Decision(True, f"v{version} is already champion", theirs, bpb)
    try:
        champion_bpb = score(theirs)
    except Exception as exc:  # noqa: BLE001 - whatever broke, the champion is not silently beaten
        return Decision(False, f"champion v{theirs} could not be scored on the yardstick ({type(exc).__name__}: "
                        f"{exc}); it stays champion (override: ultrathink registry promote {version} --force)",
                        theirs, None)
    if not math.isfinite(champion_bpb):
        return Decision(True, f"champion v{theirs} scores {champion_bpb} on the yardstick", theirs, champion_bpb)
    if bpb < champion_bpb * (1 - TIE_TOLERANCE):
        return Decision(True, f"val_bpb {bpb:.6g} < champion v{theirs}'s {champion_bpb:.6g} on the same text",
                        theirs, champion_bpb)
    return Decision(False, f"val_bpb {bpb:.6g} is not lower than champion v{theirs}'s {champion_bpb:.6g} on the "
                    f"same text (a tie within {TIE_TOLERANCE:g} keeps the champion)", theirs, champion_bpb)


def apply_guard(decision: Decision, version: int, guard: Guard | None) -> Decision:
    """The decision after `guard`, when the yardstick promoted `version` over another champion."""
    champion = decision.champion_version
    if guard is None or not decision.promoted or champion is None or champion == version:
        return decision
    try:
        record = guard(champion)
    except Exception as exc:  # noqa: BLE001 - whatever broke, the champion is not silently beaten
        return Decision(False, f"{decision.reason}, but the task guard could not compare it with champion "
                        f"v{champion} ({type(exc).__name__}: {exc}); it stays champion", champion,
                        decision.champion_bpb, {"passed": False, "reason": str(exc)})
    if record["passed"]:
        return Decision(True, f"{decision.reason}; task guard passed", champion, decision.champion_bpb, record)
    return Decision(False, f"{decision.reason}, but the task guard refuses it: {record['reason']}", champion,
                    decision.champion_bpb, record)


def decide_and_move(client: MlflowClient, name: str, version: int, bpb: float, yardstick: Yardstick, root: Path,
                    by: str, force_reason: str | None = None, guard: Guard | None = None) -> Decision:
    """Under the champion lock: judge `version` against the current champion (unless forced), then by `guard`
    when one is given, and move the alias when it wins. The champion is re-read right before the move; if another
    process moved it, judge again."""
    with champion_lock(root):
        for _ in range(_MAX_RETRIES):
            champion = current_champion(client, name)
            rolled_back = client.get_model_version(name, str(version)).tags.get("rolled_back_at")
            if force_reason is not None:
                decision = Decision(True, f"forced: {force_reason}", _number(champion), None)
            elif rolled_back and _number(champion) != version:
                decision = Decision(False, f"v{version} was rolled back ({rolled_back}); it returns only by hand: "
                                    f"ultrathink registry promote {version} --force", _number(champion), None)
            else:
                decision = judge(version, bpb, champion, lambda v: score_version(name, v, yardstick))
                decision = apply_guard(decision, version, guard)
            if not decision.promoted or _number(champion) == version:
                return decision
            if _number(current_champion(client, name)) == _number(champion):  # compare ...
                move_champion(client, name, version, by, decision.reason)  # ... and set
                return decision
            log.warning("champion of %s moved while v%s was judged; judging again", name, version)
    raise RegistryError(f"the champion of {name!r} kept moving while v{version} was judged ({_MAX_RETRIES} tries)")


def move_champion(client: MlflowClient, name: str, version: int, by: str, why: str,
                  history: list[int] | None = None) -> None:
    """Point `champion` at `version` and record who, when and why (call under champion_lock). `history`: the
    champion_history to leave (default: the current one with `version` appended)."""
    client.set_registered_model_alias(name, CHAMPION, str(version))
    _record(client, name, version, "champion", by, why)
    history = [*champion_history(client, name), version] if history is None else history
    client.set_registered_model_tag(name, HISTORY_TAG, ",".join(map(str, history[-_HISTORY_KEEP:])))


def _record(client: MlflowClient, name: str, version: int, event: str, by: str, why: str) -> None:
    """Tags `<event>_at`, `<event>_by`, `<event>_why` on a version."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for key, value in (("at", stamp), ("by", by), ("why", why[:4000])):
        client.set_model_version_tag(name, str(version), f"{event}_{key}", value)


def champion_history(client: MlflowClient, name: str) -> list[int]:
    tags = client.get_registered_model(name).tags
    return [int(v) for v in tags.get(HISTORY_TAG, "").split(",") if v.strip()]


def rollback(client: MlflowClient, name: str, root: Path, by: str, why: str) -> tuple[int, int]:
    """Champion back to the one before it in champion_history: (from version, to version). The version rolled
    back from is tagged `rolled_back_at/by/why` and leaves the history, so a second rollback goes further back."""
    with champion_lock(root):
        champion = current_champion(client, name)
        if champion is None:
            raise RegistryError(f"{name!r} has no champion to roll back from")
        current = int(champion.version)
        history = champion_history(client, name)
        while history and history[-1] == current:
            history.pop()
        live = {int(v.version) for v in client.search_model_versions(f"name='{name}'")}
        while history and history[-1] not in live:  # a deleted version cannot be champion again
            history.pop()
        if not history:
            raise RegistryError(f"{name!r}: no earlier champion than v{current} is recorded (champion_history); "
                                f"choose one with `ultrathink registry promote VERSION --force`")
        target = history[-1]
        _record(client, name, current, "rolled_back", by, why)
        move_champion(client, name, target, by, f"rollback from v{current}: {why}", history=history)
        return current, target


def describe_versions(client: MlflowClient, name: str) -> list[dict[str, str]]:
    """One row per version, oldest first: aliases, val_bpb and its yardstick, downstream task scores, lineage,
    champion moves."""
    aliases: dict[int, list[str]] = {}  # search_model_versions leaves ModelVersion.aliases empty: ask the model
    if client.search_registered_models(f"name='{name}'"):
        for alias, number in client.get_registered_model(name).aliases.items():
            aliases.setdefault(int(number), []).append(alias)
    rows = []
    for v in sorted(client.search_model_versions(f"name='{name}'"), key=lambda v: int(v.version)):
        t = v.tags
        events = "; ".join(f"{kind} {t[kind + '_at']} by {t.get(kind + '_by', '?')}: {t.get(kind + '_why', '')}"
                           for kind in ("champion", "rolled_back") if kind + "_at" in t)
        rows.append({
            "version": str(v.version), "aliases": ",".join(sorted(aliases.get(int(v.version), []))),
            "val_bpb": f"{float(t['val_bpb']):.4f}" if "val_bpb" in t else "?",
            "tasks": " ".join(f"{k.removeprefix(METRIC_PREFIX)}={float(v):.3f}" for k, v in sorted(t.items())
                              if k.startswith(METRIC_PREFIX)),
            "yardstick": f"{t.get('yardstick_sha256', '?')[:12]} ({t.get('yardstick_bytes', '?')} B)",
            "git": t.get("git_commit", "?")[:8], "data": t.get("data_hash", "?")[:12],
            "parent": t.get("parent_model", ""),
            "created": time.strftime("%Y-%m-%d %H:%M", time.gmtime(v.creation_timestamp / 1000)),
            "events": events,
        })
    return rows


def _number(version: ModelVersion | None) -> int | None:
    return int(version.version) if version is not None else None
