"""End to end on the embedded default, with the real tools: pretrain (the session's trained project) → `dvc repro`
with finetune.enabled (LoRA on the embedded question/answer pairs) → the chat model registered and promoted →
`mlflow models serve` of both champions answering as `generate` and `chat` do → guarded promotion keeps the chat
champion against a worse fine-tune → bad pairs stop at the gate with nothing registered."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from e2e_helpers import client_for, copy_project, ran_stages, set_params, sh

pytestmark = [pytest.mark.slow, pytest.mark.spawns]

QUESTION = "What colour is box 7?"
# A learnable task, so what the test asserts does not hang on one machine's numerics: every answer is "Box N is
# red.", N copied from the question. The session's base model is tiny and barely trained (12 steps when these
# figures were taken, 200 now); on the embedded pairs 60 LoRA steps lowered its held-out answer loss by 0.025 nats
# in bf16 and by 0.002 in fp32 (AVX2). Here they lower it by 0.41 in fp32.
PAIRS = [{"prompt": f"What colour is box {i}?", "response": f"Box {i} is red."} for i in range(240)]
FINETUNE = {"enabled": True, "data": "data/finetune/boxes.jsonl", "max_steps": 60, "batch_size": 8,
            "warmup_steps": 2, "eval_every": 20, "lr": 0.02, "samples": 2}


@pytest.fixture(scope="module")
def project(trained_project, tmp_path_factory) -> Path:
    """The trained project (ultrathink v1 is champion) after `dvc repro` with fine-tuning switched on. Tests that
    change it work on a copy (`changed`), so each passes alone and in any order."""
    project = copy_project(trained_project, tmp_path_factory.mktemp("finetune"))
    (project / FINETUNE["data"]).write_text("".join(json.dumps(pair) + "\n" for pair in PAIRS))
    set_params(project, {"finetune": FINETUNE})
    done = sh(["dvc", "repro"], project)
    # align (off) follows the fine-tuned champion: it records again that it is off.
    assert ran_stages(done.stdout) == ["finetune", "promote_finetuned", "align"]
    return project


@pytest.fixture
def changed(project, tmp_path) -> Path:
    return copy_project(project, tmp_path)


def report(project: Path, name: str) -> dict:
    return json.loads((project / "reports" / name).read_text())


def test_lora_fine_tuning_lowers_the_answer_loss_and_becomes_the_chat_champion(project):
    metrics = report(project, "finetune.json")
    assert metrics["ft_response_loss"] < metrics["ft_response_loss_before"] - 0.2, metrics  # fp32: 0.41, bf16: more
    assert 0 < metrics["ft_trainable_share"] < 0.5 and metrics["ft_trainable_params"] > 0
    assert metrics["ft_heldout_pairs"] > 10 and metrics["base_model"] == "models:/ultrathink/1"
    assert {"well-formed rows", "response not empty", "row count"} <= {r["name"] for r in metrics["gate"]["results"]}
    assert len(metrics["samples"]) == 2 and all({"before", "after", "reference"} <= s.keys() for s in metrics["samples"])
    decision = report(project, "finetune_promotion.json")
    assert decision["promoted"] and decision["model_name"] == "ultrathink-chat" and decision["version"] == 1
    assert decision["metric"] == "heldout_response_bpb" and decision["value"] == pytest.approx(metrics["ft_response_bpb"])
    client = client_for(project)
    version = client.get_model_version_by_alias("ultrathink-chat", "champion")
    assert version.tags["base_model"] == "models:/ultrathink/1"
    run = client.get_run(version.run_id)
    assert run.data.metrics["ft_response_loss"] == pytest.approx(metrics["ft_response_loss"])
    assert run.data.params["finetune.method"] == "lora"
    assert int(client.get_model_version_by_alias("ultrathink", "champion").version) == 1  # pretraining's untouched


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def served(project: Path, uri: str):
    """`mlflow models serve` of `uri` from the project's store on 127.0.0.1; yields the base URL."""
    port = free_port()
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               MLFLOW_TRACKING_URI=f"sqlite:///{project / 'mlflow.db'}")
    log = project / f"serve-{port}.log"
    with log.open("w") as out:
        server = subprocess.Popen(["mlflow", "models", "serve", "-m", uri, "--env-manager", "local",
                                   "-h", "127.0.0.1", "-p", str(port), "-w", "1"], cwd=project, env=env,
                                  stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(f"{url}/ping", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"the server did not come up:\n{log.read_text()[-3000:]}") from None
                time.sleep(0.5)
        yield url
    finally:
        if server.poll() is None:  # a server that died shows its own error above, not a failed kill
            os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)


def invoke(url: str, inputs: list[str], params: dict) -> list[str]:
    body = json.dumps({"inputs": inputs, "params": params}).encode()
    request = urllib.request.Request(f"{url}/invocations", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())["predictions"]


def local(project: Path, uri: str):
    from ultrathink.model import UltraThink
    from ultrathink.registry.models import resolve_model
    from ultrathink.tokenizer import load_tokenizer

    model_dir, tokenizer_dir = resolve_model(uri, project)
    return UltraThink.from_pretrained(model_dir), load_tokenizer(tokenizer_dir)


def test_served_champions_answer_as_generate_and_chat_do(project):
    from ultrathink.model.chat import reply, user
    from ultrathink.model.generate import generate_text

    greedy = {"temperature": 0.0, "max_new_tokens": 12}
    with served(project, "models:/ultrathink@champion") as url:
        answers = invoke(url, ["The", "A class"], greedy)
    model, tokenizer = local(project, "models:/ultrathink@champion")
    assert answers == [generate_text(model, tokenizer, p, 12, 0.0, None, 0) for p in ("The", "A class")]
    assert all(answers)
    generated = sh(["ultrathink", "generate", "-m", "models:/ultrathink@champion", "--prompt", "The",
                    "--temperature", "0", "--max-new-tokens", "12"], project)
    assert generated.stdout == answers[0] + "\n"

    # Several questions: this tiny chat model ends some greedy replies at once (which ones turns on the machine's
    # rounding), and the parity must hold on replies that say something.
    questions = [QUESTION] + [f"What colour is box {i}?" for i in (3, 150, 201)]
    with served(project, "models:/ultrathink-chat@champion") as url:
        answers = invoke(url, questions, greedy)
    model, tokenizer = local(project, "models:/ultrathink-chat@champion")
    assert answers == [reply(model, tokenizer, [user(q)], 12, 0.0, None, 0) for q in questions]
    assert any(answers)
    asked, answer = next((q, a) for q, a in zip(questions, answers) if a)
    chatted = sh(["ultrathink", "chat", "-m", "models:/ultrathink-chat@champion", "--message", asked,
                  "--temperature", "0", "--max-new-tokens", "12"], project)
    assert chatted.stdout == answer + "\n"


def test_a_worse_fine_tune_is_registered_but_the_chat_champion_stays(changed):
    project = changed
    set_params(project, {"finetune": {**FINETUNE, "max_steps": 2, "warmup_steps": 1, "eval_every": 2, "lr": 1e-4}})
    done = sh(["dvc", "repro"], project)
    assert ran_stages(done.stdout) == ["finetune", "promote_finetuned", "align"]
    decision = report(project, "finetune_promotion.json")
    assert decision["version"] == 2 and not decision["promoted"]
    # The champion was scored on the challenger's held-out pairs under its own code and chat tokenizer: the same
    # pairs as in the first run, so it scores what it scored then.
    assert decision["previous_champion_version"] == 1
    first = client_for(project).get_model_version("ultrathink-chat", "1")
    assert decision["previous_value"] == pytest.approx(float(first.tags["val_bpb"]), rel=1e-6)
    assert decision["value"] > decision["previous_value"]
    assert int(client_for(project).get_model_version_by_alias("ultrathink-chat", "champion").version) == 1


def test_a_new_validation_cadence_resumes_the_finished_fine_tune_under_its_recorded_plan(changed):
    """finetune.eval_every is bookkeeping (it sets when to validate and checkpoint, not the weights): changed after a
    run, the stage reads that run's plan back (no new plan is measured, which on a busy machine could decide
    otherwise and so train a new configuration) and resumes its last checkpoint, training nothing again."""
    project = changed
    finetuned, book = project / "artifacts/finetuned", project / "plans/finetune.json"
    weights, plans = load_file(finetuned / "model/model.safetensors"), json.loads(book.read_text())
    set_params(project, {"finetune": {**FINETUNE, "eval_every": 30}})
    sh(["python", "-m", "tasks.finetune"], project)
    status = json.loads((finetuned / "finetune.json").read_text())
    assert status["resumed_from"] == status["steps"] == FINETUNE["max_steps"]
    again = load_file(finetuned / "model/model.safetensors")
    assert all(torch.equal(weights[k], again[k]) for k in weights)
    assert json.loads(book.read_text()) == plans  # no new configuration was planned


def test_bad_pairs_stop_at_the_gate_and_register_nothing(changed):
    project = changed
    before = len(client_for(project).search_model_versions("name='ultrathink-chat'"))
    rows = [{"prompt": f"question {i}", "response": f"answer {i}"} for i in range(30)] + [{"prompt": "q", "response": ""}]
    (project / "data/finetune/pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    set_params(project, {"finetune": {**FINETUNE, "data": "data/finetune/pairs.jsonl"}})
    failed = sh(["dvc", "repro"], project, check=False)
    assert failed.returncode != 0 and ran_stages(failed.stdout) == ["finetune"]
    log = " ".join((failed.stdout + failed.stderr).split())
    assert "Fine-tuning pairs validation FAILED" in log and "1 of 31 responses are empty or blank" in log
    assert "line 31" in log
    assert len(client_for(project).search_model_versions("name='ultrathink-chat'")) == before


# Alignment on top of the chat champion: every box's chosen answer is green, its rejected one red — the colour
# fine-tuning taught, so before alignment the model's likelihood prefers the rejected answer on every held-out pair.
PREFERENCES = [{"prompt": f"What colour is box {i}?", "chosen": f"Box {i} is green.", "rejected": f"Box {i} is red."}
               for i in range(240)]
# 100 steps at lr 0.01, β 0.1 turned every held-out pair (bf16, AMD Zen 4); β 0.5 or 40 steps halved the likelihood
# gap (−14 → −1.8 nats) without turning it.
ALIGN = {"enabled": True, "data": "data/align/boxes.jsonl", "max_steps": 100, "batch_size": 8, "warmup_steps": 2,
         "eval_every": 50, "lr": 0.01, "beta": 0.1, "samples": 2}


@pytest.fixture(scope="module")
def aligned(project, tmp_path_factory) -> Path:
    """The fine-tuned project (ultrathink-chat v1 is champion) after `dvc repro` with alignment switched on."""
    project = copy_project(project, tmp_path_factory.mktemp("align"))
    (project / ALIGN["data"]).write_text("".join(json.dumps(pair) + "\n" for pair in PREFERENCES))
    set_params(project, {"align": ALIGN})
    done = sh(["dvc", "repro"], project)
    assert ran_stages(done.stdout) == ["align", "promote_aligned"]
    return project


def test_dpo_turns_the_held_out_preference_and_becomes_the_aligned_champion(aligned):
    metrics = report(aligned, "align.json")
    # Before: fine-tuning's red is the likelier answer on every held-out pair. After: green, on (nearly) all.
    assert metrics["align_likelihood_accuracy_before"] == 0.0 and metrics["align_likelihood_accuracy"] >= 0.8, metrics
    assert metrics["align_reward_accuracy"] >= 0.9 and metrics["align_reward_margin"] > 1.0
    assert metrics["align_preference_bits"] < metrics["align_preference_bits_before"] - 5.0
    assert metrics["align_heldout_pairs"] > 10 and metrics["base_model"] == "models:/ultrathink-chat/1"
    assert {"well-formed rows", "chosen differs from rejected", "row count"} <= {r["name"] for r in metrics["gate"]["results"]}
    assert len(metrics["samples"]) == 2 and all({"prompt", "chosen", "before", "after"} <= s.keys() for s in metrics["samples"])
    decision = report(aligned, "align_promotion.json")
    assert decision["promoted"] and decision["model_name"] == "ultrathink-aligned" and decision["version"] == 1
    assert decision["metric"] == "heldout_preference_bits"
    assert decision["value"] == pytest.approx(metrics["align_preference_bits"])
    client = client_for(aligned)
    version = client.get_model_version_by_alias("ultrathink-aligned", "champion")
    status = json.loads((aligned / "artifacts/aligned/align.json").read_text())
    assert version.tags["base_model"] == "models:/ultrathink-chat/1"
    assert version.tags["data_hash"] == status["data_hash"] and version.tags["fingerprint"] == status["fingerprint"]
    run = client.get_run(version.run_id)
    assert run.data.metrics["align_reward_accuracy"] == metrics["align_reward_accuracy"]
    assert run.data.params["align.loss"] == "sigmoid"
    assert int(client.get_model_version_by_alias("ultrathink-chat", "champion").version) == 1  # fine-tuning's untouched
    assert "up to date" in sh(["dvc", "status"], aligned).stdout


def test_a_worse_alignment_is_registered_but_the_aligned_champion_stays(aligned, tmp_path):
    project = copy_project(aligned, tmp_path)
    set_params(project, {"align": {**ALIGN, "max_steps": 2, "warmup_steps": 0, "lr": 1e-4}})
    done = sh(["dvc", "repro"], project)
    assert ran_stages(done.stdout) == ["align", "promote_aligned"]
    decision = report(project, "align_promotion.json")
    assert decision["version"] == 2 and not decision["promoted"] and decision["previous_champion_version"] == 1
    assert decision["value"] > decision["previous_value"]
    assert int(client_for(project).get_model_version_by_alias("ultrathink-aligned", "champion").version) == 1


def test_bad_preferences_stop_at_the_gate_and_register_nothing(aligned, tmp_path):
    project = copy_project(aligned, tmp_path)
    rows = PREFERENCES[:30] + [{"prompt": "q", "chosen": "same", "rejected": "same"}]
    (project / "data/align/bad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    set_params(project, {"align": {**ALIGN, "data": "data/align/bad.jsonl"}})
    failed = sh(["dvc", "repro"], project, check=False)
    assert failed.returncode != 0 and ran_stages(failed.stdout) == ["align"]
    log = " ".join((failed.stdout + failed.stderr).split())
    assert "Preference pairs validation FAILED" in log and "1 of 31 rows have the same chosen and rejected" in log
    assert "line 31" in log
    assert len(client_for(project).search_model_versions("name='ultrathink-aligned'")) == 1
