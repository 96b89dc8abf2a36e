"""Every device honoured: inference runs where it is told (or where its model is), and nothing it makes lands on
torch's default device. The inference paths are run with device="cpu" while torch's default device is `meta`: a
tensor created without an explicit device then lands on meta, and the call fails."""

import contextlib
import logging
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from ultrathink.cli import app
from ultrathink.config import ModelConfig, TokenizerConfig
from ultrathink.device import DeviceError, device_type, is_cuda, place, resolve_device
from ultrathink.model.chat import reply, save_chat_tokenizer, stream_reply, user
from ultrathink.io import atomic_write_json
from ultrathink.model import UltraThink
from ultrathink.model.generate import generate, generate_text, stream_text
from ultrathink.registry.pyfunc_model import DEVICE_ENV, UltraThinkModel
from ultrathink.scoring import score_conversations, score_documents
from ultrathink.text_eval import ModelFiles, score_model
from ultrathink.tokenizer import load_tokenizer, train_tokenizer
from ultrathink.train.precision import resolve_precision

TEXT = [f"The cat number {i} sat on the mat and looked at the dog, which barked {i % 7} times." for i in range(200)]
CHATS = [[user("Where is the cat?"), {"role": "assistant", "content": "On the mat."}]]
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
GENERATION = {"max_new_tokens": 12, "temperature": 1.0, "top_k": None, "top_p": 0.9, "seed": 3}


@contextlib.contextmanager
def only_explicit_devices():
    """torch's default device is meta for the block: what is created without a device cannot compute."""
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(None)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> Path:
    """artifacts/{model,tokenizer}: a tiny random model and its tokenizer; chat/{model,tokenizer}: the same model
    with the chat tokenizer; generation.json: the registered model's defaults."""
    root = tmp_path_factory.mktemp("devices")
    train_tokenizer(TEXT, TokenizerConfig(vocab_size=300), root / "artifacts" / "tokenizer")
    torch.manual_seed(0)
    model = UltraThink(ModelConfig(d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, seq_len=48, dropout=0.0),
                       len(load_tokenizer(root / "artifacts" / "tokenizer")))
    model.save_pretrained(root / "artifacts" / "model")
    shutil.copytree(root / "artifacts" / "model", root / "chat" / "model")
    save_chat_tokenizer(root / "artifacts" / "tokenizer", root / "chat" / "tokenizer")
    atomic_write_json(root / "generation.json", GENERATION)
    return root


def loaded(artifacts: Path, chat: bool = False):
    where = artifacts / ("chat" if chat else "artifacts")
    return UltraThink.from_pretrained(where / "model"), load_tokenizer(where / "tokenizer")


# ---- (a) every inference path puts what it makes on the device it was given ---------------------------------------
def test_generation_runs_on_the_given_device_and_samples_as_before(artifacts):
    model, tokenizer = loaded(artifacts)  # built before the default device changes
    ids = torch.tensor([tokenizer.encode("The cat")], dtype=torch.long)
    expected_text = generate_text(model, tokenizer, "The cat", 12, 1.0, None, 3, 0.9)
    expected_ids = generate(model, ids, 12, 1.0, None, 0.9, tokenizer.eos_token_id, seed=3)
    with only_explicit_devices():
        text = generate_text(model, tokenizer, "The cat", 12, 1.0, None, 3, 0.9, device="cpu")
        pieces = list(stream_text(model, tokenizer, "The cat", 12, 1.0, None, 3, 0.9, device="cpu"))
        out = generate(model, ids, 12, 1.0, None, 0.9, tokenizer.eos_token_id, seed=3, device="cpu")
    assert text == expected_text == "".join(pieces) and text  # the same seeded sample on the same device
    assert out.device.type == "cpu" and torch.equal(out, expected_ids)


def test_scoring_runs_on_the_models_device(artifacts):
    model, tokenizer = loaded(artifacts)
    chat_model, chat_tokenizer = loaded(artifacts, chat=True)
    expected = score_documents(model, tokenizer, TEXT[:5])
    expected_chats = score_conversations(chat_model, chat_tokenizer, CHATS)
    with only_explicit_devices():
        score = score_documents(model, tokenizer, TEXT[:5])
        chats = score_conversations(chat_model, chat_tokenizer, CHATS)
        by_files = score_model(ModelFiles(artifacts / "artifacts" / "model", artifacts / "artifacts" / "tokenizer"),
                               TEXT[:5], device="cpu")
    assert score == expected == by_files and chats == expected_chats


def test_a_registered_model_is_scored_under_its_own_code_on_the_given_device(artifacts, tmp_path):
    """The snapshot scorer (another process) gets the device too."""
    shutil.copytree(Path(__import__("ultrathink").__file__).parent, tmp_path / "code" / "ultrathink",
                    ignore=shutil.ignore_patterns("__pycache__"))
    model, tokenizer = loaded(artifacts)
    files = ModelFiles(artifacts / "artifacts" / "model", artifacts / "artifacts" / "tokenizer", tmp_path / "code")
    assert score_model(files, TEXT[:5], device="cpu") == score_documents(model, tokenizer, TEXT[:5])


def test_chat_replies_on_the_given_device(artifacts):
    model, tokenizer = loaded(artifacts, chat=True)
    expected = reply(model, tokenizer, [user("Where is the cat?")], 12, 1.0, None, 3, 0.9)
    with only_explicit_devices():
        answer = reply(model, tokenizer, [user("Where is the cat?")], 12, 1.0, None, 3, 0.9, device="cpu")
        pieces = list(stream_reply(model, tokenizer, [user("Where is the cat?")], 12, 1.0, None, 3, 0.9,
                                   device="cpu"))
    assert answer == expected == "".join(pieces)


@pytest.mark.parametrize("chat", [False, True], ids=["pretrained", "chat"])
def test_the_registered_model_predicts_on_the_given_device(artifacts, chat, monkeypatch):
    where = artifacts / ("chat" if chat else "artifacts")
    context = SimpleNamespace(artifacts={"model": str(where / "model"), "tokenizer": str(where / "tokenizer"),
                                         "generation": str(artifacts / "generation.json")})
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    wrapper = UltraThinkModel()
    wrapper.load_context(context)
    assert next(wrapper.model.parameters()).device.type == "cpu"
    expected = wrapper.predict(None, ["The cat", "Where is the cat?"])
    with only_explicit_devices():
        moved = wrapper.predict(None, ["The cat", "Where is the cat?"], params={"device": "cpu"})
        stays = wrapper.predict(None, ["The cat", "Where is the cat?"], params={"device": "auto"})
    assert moved == stays == expected and all(expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cpu_loaded_model_generates_and_scores_on_the_gpu_when_told(artifacts):
    model, tokenizer = loaded(artifacts)
    with only_explicit_devices():
        text = generate_text(model, tokenizer, "The cat", 12, 1.0, None, 3, 0.9, device="cuda")
        score = score_documents(model, tokenizer, TEXT[:5])
    assert text and next(model.parameters()).is_cuda and score.tokens > 0
    files = ModelFiles(artifacts / "artifacts" / "model", artifacts / "artifacts" / "tokenizer")
    assert score_model(files, TEXT[:5], device="cuda:0").bits_per_byte == pytest.approx(score.bits_per_byte, rel=1e-4)


@NO_GPU
def test_the_registered_model_refuses_a_device_the_machine_lacks(artifacts, monkeypatch):
    context = SimpleNamespace(artifacts={"model": str(artifacts / "artifacts" / "model"),
                                         "tokenizer": str(artifacts / "artifacts" / "tokenizer"),
                                         "generation": str(artifacts / "generation.json")})
    monkeypatch.setenv(DEVICE_ENV, "cuda:1")
    with pytest.raises(DeviceError, match="'cuda:1' is not available"):
        UltraThinkModel().load_context(context)


# ---- (b) one helper resolves devices; accelerators are known by device type ----------------------------------------
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:1", torch.device("cuda"), torch.device("cuda", 1)],
                         ids=str)
def test_a_gpu_is_a_gpu_whatever_its_spelling(device):
    assert is_cuda(device) and device_type(device) == "cuda"


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu"), "meta"], ids=str)
def test_the_cpu_is_no_gpu(device):
    assert not is_cuda(device)


@pytest.mark.parametrize("device", ["cuda:1", torch.device("cuda"), torch.device("cuda", 0)], ids=str)
def test_precision_auto_on_any_gpu_spelling_asks_the_gpu_and_measures_no_cpu(device, caplog):
    """The CPU path measures matmuls and logs them; a GPU's answer is whether it has bf16."""
    with caplog.at_level(logging.INFO, logger="ultrathink.train.precision"):
        resolve_precision.__wrapped__("auto", "cpu")  # the CPU path, uncached: it does log its measurement
        assert "matmul" in caplog.text
        caplog.clear()
        chosen = resolve_precision.__wrapped__("auto", device)
    assert chosen == ("bf16" if torch.cuda.is_bf16_supported() else "fp32")
    assert "matmul" not in caplog.text


def test_auto_is_the_gpu_when_there_is_one():
    expected = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device(None) == resolve_device("auto") == resolve_device(" AUTO ") == expected
    assert resolve_device("cpu") == resolve_device(torch.device("cpu")) == torch.device("cpu")


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "cpu0"])
def test_a_name_that_is_no_device_is_named(bad):
    with pytest.raises(DeviceError, match=f"device '{bad}' is not a device"):
        resolve_device(bad)


@NO_GPU
@pytest.mark.parametrize("missing", ["cuda", "cuda:1", torch.device("cuda", 0)], ids=str)
def test_a_gpu_this_machine_lacks_is_named(missing, artifacts):
    with pytest.raises(DeviceError, match=rf"device '{missing}' is not available: .* no CUDA GPU"):
        resolve_device(missing)
    with pytest.raises(DeviceError, match="is not available"):
        UltraThink.from_pretrained(artifacts / "artifacts" / "model", device=missing)


def test_place_moves_a_model_only_when_told(artifacts):
    model, _ = loaded(artifacts)
    assert place(model, None) == torch.device("cpu") == place(model, "cpu")


# ---- (c) the CLI's --device -------------------------------------------------------------------------------------
def cli(*args: str):
    return CliRunner().invoke(app, list(args))


def test_generate_and_chat_and_eval_run_on_the_cpu_when_told(artifacts, tmp_path):
    model, tokenizer = loaded(artifacts)
    done = cli("generate", "--model", str(artifacts / "artifacts" / "model"), "--prompt", "The cat",
               "--temperature", "0", "--max-new-tokens", "12", "--device", "cpu")
    assert done.exit_code == 0, done.output
    assert done.output == generate_text(model, tokenizer, "The cat", 12, 0.0, None, 0) + "\n"
    chat_model, chat_tokenizer = loaded(artifacts, chat=True)
    done = cli("chat", "--model", str(artifacts / "chat"), "--message", "Where is the cat?", "--temperature", "0",
               "--max-new-tokens", "12", "--device", "cpu")
    assert done.exit_code == 0, done.output
    assert done.output == reply(chat_model, chat_tokenizer, [user("Where is the cat?")], 12, 0.0, None, 0) + "\n"
    (tmp_path / "text.txt").write_text("\n\n".join(TEXT[:5]), encoding="utf-8")
    done = cli("eval", "--model", str(artifacts / "artifacts" / "model"), "--text-file", str(tmp_path / "text.txt"),
               "--device", "cpu")
    assert done.exit_code == 0, done.output
    assert f"bits/byte {score_documents(model, tokenizer, TEXT[:5]).bits_per_byte:.4f}" in done.output


@NO_GPU
@pytest.mark.parametrize("command", ["generate", "chat", "eval"])
def test_a_gpu_this_machine_lacks_stops_the_command_naming_it(artifacts, command, tmp_path):
    (tmp_path / "text.txt").write_text(TEXT[0], encoding="utf-8")
    extra = {"generate": ["--prompt", "The cat"], "chat": ["--message", "Hi"],
             "eval": ["--text-file", str(tmp_path / "text.txt")]}[command]
    done = cli(command, "--model", str(artifacts / "chat"), *extra, "--device", "cuda")
    said = " ".join(done.output.split())  # rich wraps the message at the terminal's width
    assert done.exit_code == 2
    assert "--device: device 'cuda' is not available" in said and "no CUDA GPU" in said


FIRST_CALLS = """
import torch
from ultrathink.model.model import RotaryEmbedding  # the package's import settles the math (device.settle_cpu_math)
first, again = RotaryEmbedding(48, 128, 10000.0), RotaryEmbedding(48, 128, 10000.0)  # on torch's default threads
print(torch.equal(first.cos, again.cos) and torch.equal(first.sin, again.sin))
"""


@pytest.mark.spawns
def test_a_fresh_process_builds_the_rotary_tables_it_builds_again():
    """oneMKL picks each float function's kernel on its first call, and a first call split over threads can give
    one thread's share a low-accuracy kernel (pytorch/pytorch#188792): without device.settle_cpu_math the first
    rotary tables of a fresh process differed from its second ones in about one process of three here (cos(64) =
    0.3918521 for 0.3918572 on half of the rows), and the trained weights with them."""

    # one after another: the race needs both threads running at once, which processes side by side on a
    # machine's few cores would hide
    runs = [subprocess.run([sys.executable, "-c", FIRST_CALLS], capture_output=True, text=True, timeout=120)
            for _ in range(4)]
    assert [(run.returncode, run.stdout.strip()) for run in runs] == [(0, "True")] * 4, [r.stderr for r in runs]
