"""The registry against a real MLflow store (SQLite in a temp dir): log, register, aliases, load, predict."""

from __future__ import annotations

import json
import warnings

import mlflow
import pandas as pd
import pytest
import torch
from mlflow.tracking import MlflowClient

from ultrathink.config import EvaluateConfig, ModelConfig, RegistryConfig, TokenizerConfig
from ultrathink.evaluate import Yardstick
from ultrathink.model import UltraThink
from ultrathink.model.generate import generate_text
from ultrathink.registry.promote import champion_uri, promote
from ultrathink.registry.tracking import load_run_id, save_run_id, start_or_resume_run
from ultrathink.tokenizer import load_tokenizer, train_tokenizer

TINY = ModelConfig(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, seq_len=32)
REG = RegistryConfig(model_name="tiny", experiment="tiny-exp")
EVAL = EvaluateConfig(max_new_tokens=8, temperature=0.8, top_k=20, seed=0)
TAGS = {"git_commit": "abc123", "params_hash": "p" * 16, "data_hash": "d" * 16}
TEXT = ["def f(x):\n    return x + 1\n", "The class statement defines a class.", "A loop runs the body."] * 20


def make_tokenizer(out_dir) -> None:
    train_tokenizer(TEXT, TokenizerConfig(vocab_size=300), out_dir)


YARDSTICK = Yardstick(("A class runs the loop.", "def g(y):\n    return y + 2\n", "The body defines a class."))


def make_model(out_dir, vocab_size: int, seed: int, quality: str = "random", tokenizer_dir=None) -> None:
    """random: as initialised; worse: random with sharpened logits; better: trained briefly on TEXT (not on the
    yardstick's sentences)."""
    torch.manual_seed(seed)
    model = UltraThink(TINY, vocab_size)
    if quality == "worse":
        with torch.no_grad():
            model.embed.weight.mul_(8.0)
    if quality == "better":
        tok = load_tokenizer(tokenizer_dir)
        stream = torch.tensor(sum((tok(t)["input_ids"] + [tok.eos_token_id] for t in TEXT[:3]), []) * 20)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(40):
            start = (step * 7) % (len(stream) - 33)
            window = stream[start : start + 33][None]
            loss = model(window[:, :-1], window[:, 1:]).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.save_pretrained(out_dir)


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    """Three promotions in a fresh store, all judged on YARDSTICK: a random model, a worse one, a better one."""
    root = tmp_path_factory.mktemp("registry")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root}/mlflow.db")
        make_tokenizer(root / "tokenizer")
        vocab = len(load_tokenizer(root / "tokenizer"))
        decisions = []
        for i, quality in enumerate(["random", "worse", "better"]):
            model_dir = root / f"model{i}"
            make_model(model_dir, vocab, seed=0, quality=quality, tokenizer_dir=root / "tokenizer")
            decisions.append(promote(model_dir, root / "tokenizer", YARDSTICK, REG, EVAL, TAGS, run_id=None,
                                     root=root))
        yield root, decisions


@pytest.mark.spawns
def test_first_model_becomes_champion(registry):
    _, decisions = registry
    first = decisions[0]
    assert first["promoted"] and first["version"] == 1 and first["previous_champion_version"] is None
    assert first["reason"] == "no champion yet"
    assert first["yardstick"] == YARDSTICK.describe()
    json.dumps(first)  # the stage writes it as a report


@pytest.mark.spawns
def test_worse_model_is_only_challenger(registry):
    _, decisions = registry
    worse = decisions[1]
    assert not worse["promoted"] and worse["version"] == 2
    assert worse["previous_champion_version"] == 1
    assert worse["previous_value"] == pytest.approx(decisions[0]["value"])  # the champion, scored again
    assert worse["value"] > worse["previous_value"] and "not lower" in worse["reason"]


@pytest.mark.spawns
def test_better_model_takes_champion(registry):
    _, decisions = registry
    better = decisions[2]
    assert better["promoted"] and better["previous_champion_version"] == 1
    assert better["value"] < better["previous_value"] and "on the same text" in better["reason"]
    client = MlflowClient()
    assert int(client.get_model_version_by_alias("tiny", "champion").version) == 3
    assert int(client.get_model_version_by_alias("tiny", "challenger").version) == 3


@pytest.mark.spawns
def test_version_carries_lineage_tags_and_run(registry):
    _, decisions = registry
    version = MlflowClient().get_model_version("tiny", "2")
    assert {k: version.tags[k] for k in TAGS} == TAGS
    assert float(version.tags["val_bpb"]) == decisions[1]["value"]
    assert version.tags["yardstick_sha256"] == YARDSTICK.sha256
    assert version.run_id == decisions[1]["run_id"]
    assert mlflow.get_run(version.run_id).data.metrics["val_bpb"] == pytest.approx(decisions[1]["value"])
    logged = mlflow.artifacts.download_artifacts(run_id=version.run_id, artifact_path="yardstick/yardstick.jsonl")
    assert open(logged, encoding="utf-8").read() == YARDSTICK.jsonl()


@pytest.mark.spawns
def test_artifacts_stay_under_root(registry):
    root, decisions = registry
    assert (root / "mlartifacts").is_dir()
    assert any((root / "mlartifacts").rglob("model.safetensors"))
    assert not any((root / "mlartifacts").rglob("*.pkl"))  # models-from-code: nothing pickled


@pytest.mark.spawns
def test_champion_predicts_like_generate_text(registry):
    root, _ = registry
    pyfunc = mlflow.pyfunc.load_model(champion_uri(REG))
    prompts = ["The", "A class"]
    out = pyfunc.predict(prompts)
    assert isinstance(out, list) and len(out) == 2 and all(isinstance(t, str) for t in out)
    assert len(pyfunc.predict(pd.DataFrame({"prompt": prompts}))) == 2
    assert len(pyfunc.predict("The")) == 1

    model, tokenizer = UltraThink.from_pretrained(root / "model2"), load_tokenizer(root / "tokenizer")
    greedy = {"temperature": 0.0}
    first = pyfunc.predict(["def f"], params=greedy)
    assert first == pyfunc.predict(["def f"], params=greedy)
    assert first == [generate_text(model, tokenizer, "def f", max_new_tokens=EVAL.max_new_tokens, temperature=0.0,
                                   top_k=EVAL.top_k, seed=EVAL.seed)]
    # Without params, the EvaluateConfig values logged with the model apply (seeded sampling is repeatable).
    assert pyfunc.predict(["def f"]) == [generate_text(model, tokenizer, "def f", **EVAL.model_dump(
        include={"max_new_tokens", "temperature", "top_k", "seed"}))]


def test_diverged_model_never_becomes_champion(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    make_tokenizer(tmp_path / "tokenizer")
    make_model(tmp_path / "model", len(load_tokenizer(tmp_path / "tokenizer")), seed=0)
    decision = promote(tmp_path / "model", tmp_path / "tokenizer", YARDSTICK, REG, EVAL, TAGS, None, tmp_path,
                       known_bpb=float("nan"))
    assert not decision["promoted"] and "not finite" in decision["reason"]
    assert "champion" not in MlflowClient().get_registered_model(REG.model_name).aliases


def test_promote_reopens_the_training_run(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    make_tokenizer(tmp_path / "tokenizer")
    make_model(tmp_path / "model", len(load_tokenizer(tmp_path / "tokenizer")), seed=0)
    with start_or_resume_run(REG.experiment, tmp_path, run_name="train") as run:
        mlflow.log_metric("train_loss", 5.0, step=1)
        save_run_id(tmp_path / "model", run.info.run_id)
    run_id = load_run_id(tmp_path / "model")
    decision = promote(tmp_path / "model", tmp_path / "tokenizer", YARDSTICK, REG, EVAL, TAGS, run_id, tmp_path)
    assert decision["run_id"] == run_id
    assert set(mlflow.get_run(run_id).data.metrics) == {"train_loss", "val_bpb"}


def test_unknown_run_id_starts_a_new_run(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    with pytest.warns(UserWarning, match="unknown"):
        with start_or_resume_run(REG.experiment, tmp_path, run_id="0" * 32) as run:
            new_id = run.info.run_id
    assert new_id != "0" * 32
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with start_or_resume_run(REG.experiment, tmp_path, run_id=new_id) as run:
            assert run.info.run_id == new_id
    assert not [w for w in caught if "unknown" in str(w.message)]
