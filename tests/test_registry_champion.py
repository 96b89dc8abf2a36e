"""Champion moves against a real MLflow store (SQLite in a temp dir, no mocks): one yardstick per decision, a
champion that cannot be scored is kept, concurrent promotions from two processes, retried promotes, and the
`ultrathink registry` commands (list, promote, rollback).

Models of clearly different quality come from a few dozen steps of a plain torch loop on template sentences; the
yardsticks are other sentences of the same template (never trained on), except YARD_HARD, text unlike the training
text, on which every model scores badly.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from filelock import FileLock
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from ultrathink.cli import app
from ultrathink.config import EvaluateConfig, ModelConfig, RegistryConfig, TokenizerConfig
from ultrathink.evaluate import Yardstick, encode_documents, score_documents
from ultrathink.model import UltraThink
from ultrathink.registry.champion import actor, champion_history, lock_path, rollback, version_yardstick
from ultrathink.registry.promote import promote
from ultrathink.registry.tracking import ensure_experiment, use_tracking
from ultrathink.tokenizer import load_tokenizer, train_tokenizer

REPO = Path(__file__).resolve().parents[1]
TINY = ModelConfig(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, seq_len=32)
NAME = "tiny"
REG = RegistryConfig(model_name=NAME, experiment="tiny-exp")
EVAL = EvaluateConfig(max_new_tokens=8, temperature=0.8, top_k=20, seed=0)
TAGS = {"git_commit": "abc123", "data_hash": "d" * 16}

_ADJ = ["red", "big", "small", "old", "quick", "lazy", "green", "happy"]
_NOUN = ["cat", "dog", "bird", "fox", "horse", "mouse", "frog", "bear"]
_VERB = ["sees", "chases", "likes", "finds", "follows", "hears"]
_SENTENCES = [f"the {a} {n} {v} the {m}." for a, n, v, m in itertools.product(_ADJ, _NOUN, _VERB, _NOUN)]
random.Random(0).shuffle(_SENTENCES)
TRAIN = _SENTENCES[:2000]  # disjoint from every yardstick below
YARD_A = Yardstick(tuple(_SENTENCES[2000:2040]))
YARD_B = Yardstick(tuple(_SENTENCES[2040:2080]))
YARD_C = Yardstick(tuple(_SENTENCES[2080:2120]))
YARD_HARD = Yardstick(tuple(f"Quixotic {w} vexes {n} wyverns; JAZZ-{n * 7} zig {w[::-1]}!"
                            for w, n in zip(["onyx", "kiwi", "plume", "quartz", "vortex"] * 4, range(20))))


# ---- helpers ----

def make_tokenizer(out_dir) -> None:
    train_tokenizer(TRAIN, TokenizerConfig(vocab_size=300), out_dir)


def train_model(out_dir: Path, tokenizer, steps: int, seed: int = 0) -> Path:
    """A tiny model after `steps` AdamW steps on random windows of TRAIN (0 steps: untrained)."""
    torch.manual_seed(seed)
    model = UltraThink(TINY, len(tokenizer))
    stream = encode_documents(tokenizer, TRAIN)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(stream) - TINY.seq_len - 1, (16,), generator=gen)
        rows = torch.stack([stream[s : s + TINY.seq_len + 1] for s in starts])
        loss = model(rows[:, :-1], rows[:, 1:]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(out_dir)
    return out_dir


def bpb(model_dir: Path, tokenizer_dir: Path, yardstick: Yardstick) -> float:
    """What the registry should measure: bits per byte of `yardstick` under this model and its tokenizer."""
    model = UltraThink.from_pretrained(model_dir)
    return score_documents(model, load_tokenizer(tokenizer_dir), yardstick.documents).bits_per_byte


def alias_version(client: MlflowClient, alias: str) -> int:
    return int(client.get_model_version_by_alias(NAME, alias).version)


def version_tags(client: MlflowClient, version: int) -> dict[str, str]:
    return client.get_model_version(NAME, str(version)).tags


def one_line(text: str) -> str:
    """Rich wraps long messages at the console width: compare with whitespace collapsed."""
    return " ".join(text.split())


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny tensors gain nothing from torch's thread pool, and on a busy machine its threads fight for cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> SimpleNamespace:
    """One tokenizer and four models of increasing quality, each model dir named `model` beside a `tokenizer` dir
    as in the pipeline (artifacts/model, artifacts/tokenizer). Read-only for the tests."""
    base = tmp_path_factory.mktemp("champion-assets")
    make_tokenizer(base / "tokenizer")
    tokenizer = load_tokenizer(base / "tokenizer")
    dirs = {name: train_model(base / name / "model", tokenizer, steps)
            for name, steps in (("untrained", 0), ("weak", 10), ("strong", 25), ("best", 60))}
    a = SimpleNamespace(tok=base / "tokenizer", base=base, **dirs)
    # The premises the tests rely on: each model clearly beats the previous one on every template yardstick.
    for yardstick in (YARD_A, YARD_B, YARD_C):
        scores = [bpb(dirs[n], a.tok, yardstick) for n in ("untrained", "weak", "strong", "best")]
        assert all(x > 1.05 * y for x, y in zip(scores, scores[1:])), scores
    return a


@pytest.fixture(scope="module")
def empty_store(tmp_path_factory) -> Path:
    """An empty SQLite store, migrated once and copied for each test (MLflow's migrations take seconds)."""
    path = tmp_path_factory.mktemp("empty-store") / "mlflow.db"
    uri = f"sqlite:///{path}"
    MlflowClient(uri, uri).search_registered_models(max_results=1)
    return path


def new_store(empty_store: Path, root: Path, monkeypatch) -> str:
    """A store of its own at root/mlflow.db, named by MLFLOW_TRACKING_URI and made this process's current one."""
    for var in ("DVC_ROOT", "DVC_EXP_NAME", "DVC_EXP_BASELINE_REV"):
        monkeypatch.delenv(var, raising=False)
    shutil.copy(empty_store, root / "mlflow.db")
    uri = f"sqlite:///{root}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    use_tracking(root)  # points this process's (global) MLflow client at it
    return uri


@pytest.fixture
def store(empty_store, tmp_path, monkeypatch) -> Path:
    """A fresh store for this test only; returns the project root the promotions use."""
    new_store(empty_store, tmp_path, monkeypatch)
    return tmp_path


def do_promote(model_dir: Path, tok: Path, yardstick: Yardstick, root: Path, run_id: str | None = None) -> dict:
    return promote(model_dir, tok, yardstick, REG, EVAL, TAGS, run_id, root)


# ---- 1. one yardstick per decision ----

@pytest.mark.spawns
def test_champion_is_judged_on_the_challengers_own_text(assets, store):
    client = MlflowClient()
    # v1: the strong model, measured on text unlike its training text, so its recorded val_bpb is poor.
    first = do_promote(assets.strong, assets.tok, YARD_HARD, store)
    assert first["promoted"] and first["version"] == 1 and first["reason"] == "no champion yet"
    assert first["previous_champion_version"] is None and first["previous_value"] is None
    assert first["value"] == pytest.approx(bpb(assets.strong, assets.tok, YARD_HARD), rel=1e-6)

    # v2: the weak model on YARD_B. Its val_bpb is below v1's *recorded* val_bpb (a comparison of numbers measured
    # on different texts would promote it), but v1 scored on YARD_B is far better: v2 must not take champion.
    worse = do_promote(assets.weak, assets.tok, YARD_B, store)
    strong_on_b = bpb(assets.strong, assets.tok, YARD_B)
    assert worse["value"] < first["value"]
    assert not worse["promoted"] and worse["version"] == 2
    assert worse["previous_champion_version"] == 1
    assert worse["previous_value"] == pytest.approx(strong_on_b, rel=1e-6)
    assert worse["previous_value"] != pytest.approx(first["value"], rel=1e-3)  # re-scored, not v1's own number
    assert "not lower" in worse["reason"] and "on the same text" in worse["reason"]
    assert alias_version(client, "champion") == 1 and alias_version(client, "challenger") == 2
    assert "champion_at" not in version_tags(client, 2)

    # v3: the best model on YARD_C: better than v1 on that text, so it takes champion.
    better = do_promote(assets.best, assets.tok, YARD_C, store)
    strong_on_c = bpb(assets.strong, assets.tok, YARD_C)
    assert better["promoted"] and better["version"] == 3
    assert better["previous_champion_version"] == 1
    assert better["previous_value"] == pytest.approx(strong_on_c, rel=1e-6)
    assert better["value"] == pytest.approx(bpb(assets.best, assets.tok, YARD_C), rel=1e-6)
    assert better["value"] < better["previous_value"]
    assert "on the same text" in better["reason"] and "champion v1" in better["reason"]
    assert better["yardstick"] == YARD_C.describe()
    assert alias_version(client, "champion") == 3 and alias_version(client, "challenger") == 3

    # What was recorded: who/when/why on the champions, the history, and each version's yardstick.
    tags = version_tags(client, 3)
    assert tags["champion_why"] == better["reason"]
    assert tags["champion_by"].startswith("promote stage (")
    assert time.strptime(tags["champion_at"], "%Y-%m-%dT%H:%M:%SZ")
    assert version_tags(client, 1)["champion_why"] == "no champion yet"
    assert champion_history(client, NAME) == [1, 3]
    assert tags["yardstick_sha256"] == YARD_C.sha256 and float(tags["val_bpb"]) == better["value"]
    assert version_yardstick(client.get_model_version(NAME, "3")) == YARD_C
    assert version_yardstick(client.get_model_version(NAME, "2")) == YARD_B
    assert {k: tags[k] for k in TAGS} == TAGS


# ---- 2. a champion that cannot be scored stays ----

def test_unscorable_champion_is_kept(assets, store):
    client = MlflowClient()
    first = do_promote(assets.weak, assets.tok, YARD_A, store)
    assert first["promoted"] and first["version"] == 1
    # Lose v1's logged model (its weights) from the artifact store.
    logged = list((store / "mlartifacts" / "models").iterdir())
    assert len(logged) == 1 and (logged[0] / "artifacts" / "MLmodel").is_file()
    shutil.rmtree(logged[0])

    second = do_promote(assets.best, assets.tok, YARD_A, store)
    assert second["version"] == 2 and not second["promoted"]
    assert "could not be scored" in second["reason"] and "champion v1" in second["reason"]
    assert "--force" in second["reason"]  # says how to override
    assert second["previous_champion_version"] == 1 and second["previous_value"] is None
    assert alias_version(client, "champion") == 1 and alias_version(client, "challenger") == 2
    assert champion_history(client, NAME) == [1]
    assert "champion_at" not in version_tags(client, 2)


# ---- 3. two promotions at once, from two processes ----

_PROMOTE_SCRIPT = """
import json, os, sys, time
from pathlib import Path
args = json.loads(sys.argv[1])
from ultrathink.config import EvaluateConfig, RegistryConfig
from ultrathink.evaluate import Yardstick
from ultrathink.registry.promote import promote
Path(args["ready"]).touch()
for step in args["rounds"]:  # one promotion per store, each when the test says go
    deadline = time.time() + 120
    while not Path(step["go"]).exists():
        if time.time() > deadline:
            sys.exit("no go signal")
        time.sleep(0.01)
    os.environ["MLFLOW_TRACKING_URI"] = "sqlite:///" + step["root"] + "/mlflow.db"
    decision = promote(Path(args["model"]), Path(args["tokenizer"]), Yardstick(tuple(args["yardstick"])),
                       RegistryConfig(**args["registry"]), EvaluateConfig(max_new_tokens=8), {"who": args["who"]},
                       None, Path(step["root"]))
    Path(step["out"]).write_text(json.dumps(decision))
"""


@pytest.mark.spawns
@pytest.mark.slow
def test_concurrent_promotions_leave_the_better_model_champion(assets, empty_store, tmp_path, monkeypatch):
    """Two processes promote the strong and the weak model into one store at once, in three rounds (a store each):
    the strong one with a head start, the weak one with a head start, and both let go together while this test
    holds the champion lock over a store whose champion (an untrained model) both beat, so that both wait for the
    lock with the same champion in view. Every time: both versions exist, the strong model ends champion, and the
    version judged second was judged against the one judged first, on the same text."""
    rounds = [SimpleNamespace(root=tmp_path / "strong-first", head_start=("strong", "weak"), contended=False),
              SimpleNamespace(root=tmp_path / "weak-first", head_start=("weak", "strong"), contended=False),
              SimpleNamespace(root=tmp_path / "contended", head_start=None, contended=True)]
    for r in rounds:  # each store and its experiment exist before the processes start
        r.root.mkdir()
        r.uri = new_store(empty_store, r.root, monkeypatch)
        if r.contended:
            assert do_promote(assets.untrained, assets.tok, YARD_B, r.root)["version"] == 1  # the champion to beat
        else:
            ensure_experiment(REG.experiment, r.root)
    script = tmp_path / "promote_rounds.py"
    script.write_text(_PROMOTE_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    procs = {}
    for who in ("strong", "weak"):
        steps = [{"root": str(r.root), "go": str(r.root / f"{who}.go"), "out": str(r.root / f"{who}.json")}
                 for r in rounds]
        args = {"model": str(getattr(assets, who)), "tokenizer": str(assets.tok), "yardstick": list(YARD_B.documents),
                "registry": REG.model_dump(), "who": who, "ready": str(tmp_path / f"{who}.ready"), "rounds": steps}
        procs[who] = subprocess.Popen([sys.executable, str(script), json.dumps(args)], cwd=tmp_path, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def wait_until(done, what: str) -> None:
        deadline = time.time() + 120
        while not done():
            assert time.time() < deadline, f"timed out waiting for {what}"
            # A promoter that finished its last round exits 0 while the other may still be judging: only a failed
            # one ends the wait early.
            if any(p.poll() not in (None, 0) for p in procs.values()):
                outputs = {w: p.communicate()[0][-3000:] for w, p in procs.items() if p.poll() not in (None, 0)}
                pytest.fail(f"a promoter failed: {outputs}")
            time.sleep(0.02)

    try:
        wait_until(lambda: all((tmp_path / f"{who}.ready").exists() for who in procs), "imports")
        for r in rounds:
            if r.contended:
                with FileLock(str(lock_path(r.uri, r.root))):
                    for who in procs:
                        (r.root / f"{who}.go").touch()
                    client = MlflowClient(r.uri, r.uri)
                    wait_until(lambda: len(client.search_model_versions(f"name='{NAME}'")) == 3, "registrations")
                    time.sleep(0.5)  # both are now waiting for the lock
                    # Nothing is decided or moved while another process holds the lock.
                    assert not any((r.root / f"{who}.json").exists() for who in procs)
                    assert alias_version(client, "champion") == 1 and champion_history(client, NAME) == [1]
            else:
                (r.root / f"{r.head_start[0]}.go").touch()
                time.sleep(0.2)  # a head start well inside one promotion (about a second): the two overlap
                (r.root / f"{r.head_start[1]}.go").touch()
            wait_until(lambda: all((r.root / f"{who}.json").exists() for who in procs), f"round {r.root.name}")
        outputs = {who: p.communicate(timeout=120)[0] for who, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    for who, p in procs.items():
        assert p.returncode == 0, f"{who} promoter failed:\n{outputs[who][-3000:]}"

    on_b = {who: bpb(getattr(assets, who), assets.tok, YARD_B) for who in ("untrained", "weak", "strong")}
    for r in rounds:
        client = MlflowClient(r.uri, r.uri)
        decisions = {who: json.loads((r.root / f"{who}.json").read_text()) for who in procs}
        seeded = [1] if r.contended else []  # the untrained champion that was there before
        versions = {int(v.version): v for v in client.search_model_versions(f"name='{NAME}'")}
        strong_v, weak_v = decisions["strong"]["version"], decisions["weak"]["version"]
        assert set(versions) == {*seeded, strong_v, weak_v} and len(versions) == len(seeded) + 2, decisions
        assert versions[strong_v].tags["who"] == "strong" and versions[weak_v].tags["who"] == "weak"
        assert alias_version(client, "champion") == strong_v, (r.root.name, decisions)
        assert decisions["strong"]["promoted"]
        # The one judged first saw the champion from before the round (none, or v1); the other saw the first.
        before = seeded[0] if seeded else None
        judged_first = [w for w, d in decisions.items() if d["previous_champion_version"] == before]
        assert len(judged_first) == 1, (r.root.name, decisions)
        first = decisions[judged_first[0]]
        assert first["promoted"]
        assert first["previous_value"] == (pytest.approx(on_b["untrained"], rel=1e-6) if seeded else None)
        if judged_first == ["strong"]:
            assert not decisions["weak"]["promoted"] and decisions["weak"]["previous_champion_version"] == strong_v
            assert decisions["weak"]["previous_value"] == pytest.approx(on_b["strong"], rel=1e-6)
            assert champion_history(client, NAME) == [*seeded, strong_v]
        else:
            assert decisions["weak"]["promoted"] and decisions["strong"]["previous_champion_version"] == weak_v
            assert decisions["strong"]["previous_value"] == pytest.approx(on_b["weak"], rel=1e-6)
            assert champion_history(client, NAME) == [*seeded, weak_v, strong_v]
        assert version_tags(client, strong_v)["champion_why"] == decisions["strong"]["reason"]


# ---- 4. a retried promote ----

@pytest.mark.spawns
def test_retried_promote_reuses_its_version(assets, store):
    client = MlflowClient()
    first = do_promote(assets.weak, assets.tok, YARD_A, store)
    again = do_promote(assets.weak, assets.tok, YARD_A, store, run_id=first["run_id"])
    assert again["version"] == first["version"] == 1 and again["run_id"] == first["run_id"]
    assert again["promoted"] and "already champion" in again["reason"]
    assert [int(v.version) for v in client.search_model_versions(f"name='{NAME}'")] == [1]
    assert len(list((store / "mlartifacts" / "models").iterdir())) == 1  # the model was not logged twice
    assert champion_history(client, NAME) == [1]  # the retry is not a second move
    assert alias_version(client, "champion") == 1 and alias_version(client, "challenger") == 1
    # Other weights in the same run are another model: a new version.
    other = do_promote(assets.strong, assets.tok, YARD_A, store, run_id=first["run_id"])
    assert other["version"] == 2 and other["run_id"] == first["run_id"] and other["promoted"]
    assert champion_history(client, NAME) == [1, 2]


@pytest.mark.spawns
def test_a_rolled_back_version_is_not_restored_by_a_retried_promote(assets, store):
    client = MlflowClient()
    do_promote(assets.weak, assets.tok, YARD_A, store)
    second = do_promote(assets.strong, assets.tok, YARD_A, store)
    assert second["promoted"] and alias_version(client, "champion") == 2
    rollback(client, NAME, store, "tester", "bad outputs")
    retried = do_promote(assets.strong, assets.tok, YARD_A, store, run_id=second["run_id"])
    assert retried["version"] == 2 and not retried["promoted"] and "was rolled back" in retried["reason"]
    assert alias_version(client, "champion") == 1


_CREATE_EXPERIMENT_SCRIPT = """
import sys, time
from pathlib import Path
from ultrathink.registry.tracking import ensure_experiment
while time.time() < float(sys.argv[2]):
    time.sleep(0.001)
print(ensure_experiment("sweep", Path(sys.argv[1])))
"""


@pytest.mark.spawns
def test_two_processes_creating_one_experiment_on_a_new_store_both_succeed(tmp_path, monkeypatch):
    """Two queued DVC experiments starting together on a project with no store yet."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    start = f"{time.time() + 4:.3f}"
    procs = [subprocess.Popen([sys.executable, "-c", _CREATE_EXPERIMENT_SCRIPT, str(tmp_path), start], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-1500:] for _, err in outputs]
    ids = {out.strip().splitlines()[-1] for out, _ in outputs}
    assert len(ids) == 1  # one experiment, found by both


# ---- 5. the `ultrathink registry` commands ----

@pytest.mark.spawns
def test_registry_cli_list_promote_rollback(assets, store, monkeypatch):
    client = MlflowClient()
    assert do_promote(assets.weak, assets.tok, YARD_A, store)["promoted"]  # v1
    assert do_promote(assets.strong, assets.tok, YARD_A, store)["promoted"]  # v2
    assert not do_promote(assets.untrained, assets.tok, YARD_A, store)["promoted"]  # v3
    assert alias_version(client, "champion") == 2 and champion_history(client, NAME) == [1, 2]
    monkeypatch.chdir(store)  # no params.yaml here: --name names the model
    assert not (store / "params.yaml").exists()
    runner = CliRunner()

    def cli(*args: str):
        return runner.invoke(app, ["registry", *args, "--name", NAME])

    listed = cli("list")
    assert listed.exit_code == 0, listed.output
    rows = {int(line.split("│")[1]): line for line in listed.stdout.splitlines()
            if line.count("│") > 2 and line.split("│")[1].strip().isdigit()}
    assert set(rows) == {1, 2, 3}
    assert {v: row.split("│")[2].strip() for v, row in rows.items()} == {1: "", 2: "champion", 3: "challenger"}
    assert "champion" in rows[1].split("│")[-2] and "champion" not in rows[3].split("│")[-2]  # events column
    for v in (1, 2, 3):
        assert f"{float(version_tags(client, v)['val_bpb']):.4f}" in rows[v]
        assert YARD_A.sha256[:12] in rows[v]
    assert "champion history (oldest first): [1, 2]" in listed.stdout

    # Worse than the champion on its own yardstick, unforced: refused, champion unchanged.
    refused = cli("promote", "3")
    assert refused.exit_code == 1, refused.output
    assert "not promoted" in refused.stdout and "on the same text" in refused.stdout
    assert alias_version(client, "champion") == 2 and "champion_at" not in version_tags(client, 3)

    # Forced, with a reason: moves, and says who and why.
    forced = cli("promote", "3", "--force", "--reason", "hotfix: v2 leaks secrets")
    assert forced.exit_code == 0, forced.output
    assert "v3: champion" in forced.stdout
    assert alias_version(client, "champion") == 3
    tags = version_tags(client, 3)
    assert tags["champion_by"] == actor() and tags["champion_why"] == "forced: hotfix: v2 leaks secrets"
    assert champion_history(client, NAME) == [1, 2, 3]

    # Rollback walks the history back one champion per call, recording why.
    back = cli("rollback", "--reason", "v3 is garbage")
    assert back.exit_code == 0, back.output
    assert "champion v3 → v2" in back.stdout
    assert alias_version(client, "champion") == 2 and champion_history(client, NAME) == [1, 2]
    tags3, tags2 = version_tags(client, 3), version_tags(client, 2)
    assert tags3["rolled_back_why"] == "v3 is garbage" and tags3["rolled_back_by"] == actor()
    assert "rolled_back_at" in tags3
    assert tags2["champion_why"] == "rollback from v3: v3 is garbage" and tags2["champion_by"] == actor()

    further = cli("rollback", "-r", "v2 too")
    assert further.exit_code == 0, further.output
    assert "champion v2 → v1" in further.stdout
    assert alias_version(client, "champion") == 1 and champion_history(client, NAME) == [1]
    assert version_tags(client, 2)["rolled_back_why"] == "v2 too"

    nothing = cli("rollback", "--reason", "again")
    assert nothing.exit_code == 1, nothing.output
    message = one_line(nothing.stderr)
    assert "registry rollback failed" in message and "no earlier champion than v1" in message
    assert "registry promote VERSION --force" in message
    assert alias_version(client, "champion") == 1 and champion_history(client, NAME) == [1]
    assert "rolled_back_at" not in version_tags(client, 1)

    # A rolled-back version, though better, returns only by hand: unforced it is refused, forced it moves.
    refused_back = cli("promote", "2")
    assert refused_back.exit_code == 1 and "was rolled back" in one_line(refused_back.stdout)
    assert alias_version(client, "champion") == 1
    regained = cli("promote", "2", "--force", "-r", "fixed upstream")
    assert regained.exit_code == 0, regained.output
    assert "v2: champion" in regained.stdout
    assert alias_version(client, "champion") == 2 and champion_history(client, NAME) == [1, 2]

    missing = cli("promote", "9", "--force")
    assert missing.exit_code == 1 and "registry promote failed" in one_line(missing.stderr)
    assert alias_version(client, "champion") == 2


# ---- 6. a model logged from dirs with other names ----

@pytest.mark.spawns
def test_champion_from_dirs_not_named_model_and_tokenizer_can_be_scored(assets, store):
    """The pyfunc stores its artifacts under the logged folders' names (artifacts/weights, artifacts/tok); the
    champion must still be found and scored (a champion that cannot be scored could never be beaten)."""
    odd = store / "odd"
    shutil.copytree(assets.weak, odd / "weights")
    shutil.copytree(assets.tok, odd / "tok")
    assert do_promote(odd / "weights", odd / "tok", YARD_A, store)["promoted"]
    better = do_promote(assets.best, assets.tok, YARD_A, store)
    assert better["promoted"], better["reason"]
    assert better["previous_champion_version"] == 1
    assert better["previous_value"] == pytest.approx(bpb(assets.weak, assets.tok, YARD_A), rel=1e-6)


def test_a_tie_within_float_noise_keeps_the_champion():
    """The same weights retrained score the same up to float summation order: that is no reason to move."""
    from mlflow.entities.model_registry import ModelVersion

    from ultrathink.registry.champion import TIE_TOLERANCE, judge

    champion = ModelVersion(NAME, "1", 0)
    tie = judge(2, 1.6656575414, champion, lambda v: 1.6656576037)
    assert not tie.promoted and "a tie within" in tie.reason and tie.champion_bpb == 1.6656576037
    better = judge(2, 1.66 * (1 - 3 * TIE_TOLERANCE), champion, lambda v: 1.66)
    assert better.promoted and "on the same text" in better.reason
