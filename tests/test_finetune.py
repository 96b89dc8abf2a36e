"""Fine-tuning's parts: the chat template and the answer-only targets, the pairs' gate, LoRA through PEFT with the
real Trainer, merging, the export's chat template, and the `ultrathink chat` command."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file
from transformers import AutoTokenizer

from ultrathink.config import (AlignConfig, FinetuneConfig, LoraSettings, ModelConfig, Params, TokenizerConfig,
                               load_params)
from ultrathink.data.validation import validate_pairs
from ultrathink.model.chat import assistant, chat_tokenizer, reply, save_chat_tokenizer, user
from ultrathink.finetune.lora import AdapterError, add_adapters, trainable_share
from ultrathink.finetune.pairs import PairsError, embedded_pairs, load_pairs, split_pairs
from ultrathink.finetune.sft import Base, build, post_training_config, score
from ultrathink.model import UltraThink
from ultrathink.model.export import export_hf
from ultrathink.scoring import IGNORE, chat_rows, encode_conversation, fit_window
from ultrathink.tokenizer import load_tokenizer, train_tokenizer
from ultrathink.train.distributed import Distributed
from ultrathink.hashing import file_sha256

ROOT = Path(__file__).resolve().parents[1]
TEXT = [f"The cat number {i} sat on the mat and looked at the dog, which barked {i % 7} times." for i in range(300)]
CHAT = [user("Where is the cat?"), assistant("On the mat."), user("And the dog?"), assistant("It barked 3 times.")]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    """artifacts/{model,tokenizer}: a tiny random model and a BPE tokenizer; chat/ the chat tokenizer."""
    root = tmp_path_factory.mktemp("ft") / "artifacts"
    train_tokenizer(TEXT, TokenizerConfig(vocab_size=320), root / "tokenizer")
    torch.manual_seed(0)
    model = UltraThink(ModelConfig(d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, seq_len=48, dropout=0.0),
                       len(load_tokenizer(root / "tokenizer")))
    model.save_pretrained(root / "model")
    save_chat_tokenizer(root / "tokenizer", root / "chat")
    return root


def chat_tok(assets: Path):
    return load_tokenizer(assets / "chat")


def test_the_answer_tokens_are_each_assistant_turn_and_its_eos(assets):
    tokenizer = chat_tok(assets)
    ids, answer = encode_conversation(tokenizer, CHAT)
    # Exactly what transformers' apply_chat_template gives for the same chat, from the saved tokenizer files.
    assert ids == tokenizer.apply_chat_template(CHAT, tokenize=True, return_dict=True)["input_ids"]
    spans, start = [], None
    for i, keep in enumerate(answer + [False]):
        if keep and start is None:
            start = i
        if not keep and start is not None:
            spans.append(tokenizer.decode(ids[start:i]))
            start = None
    assert spans == ["On the mat.<|endoftext|>", "It barked 3 times.<|endoftext|>"]
    prompt = tokenizer.decode([t for t, keep in zip(ids, answer) if not keep])
    assert prompt == "<|user|>\nWhere is the cat?<|endoftext|><|assistant|>\n<|user|>\nAnd the dog?<|endoftext|><|assistant|>\n"


def test_a_tokenizer_that_splits_the_eos_text_is_refused(assets):
    splitting = load_tokenizer(assets / "tokenizer")  # the pretraining tokenizer: EOS text is ordinary text
    splitting.chat_template = chat_tok(assets).chat_template
    with pytest.raises(ValueError, match="does not close each turn with the EOS token"):
        encode_conversation(splitting, CHAT)


def test_a_long_chat_keeps_its_answer_and_loses_the_prompt_start():
    ids, answer = list(range(100)), [False] * 90 + [True] * 10
    kept, mask = fit_window(ids, answer, 32)
    assert kept == list(range(68, 100)) and mask == [False] * 22 + [True] * 10
    ids, answer = list(range(100)), [False] * 20 + [True] * 80  # the answer alone is longer than the window
    kept, mask = fit_window(ids, answer, 32)
    assert kept == list(range(4, 36)) and mask == [False] * 16 + [True] * 16
    answer = [False] * 10 + [True] * 10 + [False] * 10 + [True] * 70  # two turns: the last answer decides
    kept, mask = fit_window(list(range(100)), answer, 32)
    assert kept == list(range(14, 46)) and mask == [True] * 6 + [False] * 10 + [True] * 16


def test_the_answer_only_loss_is_the_mean_over_answer_targets(assets):
    tokenizer, model = chat_tok(assets), UltraThink.from_pretrained(assets / "model").eval()
    chats = [CHAT[2:], [user("Tell me about the mat."), assistant("The cat sat on it.")]]
    x, y, n_bytes = chat_rows(tokenizer, chats, model.cfg.seq_len + 1)
    with torch.no_grad():
        logits = model(x).logits
    manual, count = 0.0, 0
    for row in range(len(chats)):
        ids, answer = encode_conversation(tokenizer, chats[row])
        assert len(ids) <= model.cfg.seq_len  # not cropped
        for t in range(len(ids) - 1):
            if answer[t + 1]:
                manual -= F.log_softmax(logits[row, t].float(), -1)[ids[t + 1]].item()
                count += 1
    assert int((y != IGNORE).sum()) == count
    result = score(model, tokenizer, chats)
    assert result.tokens == count and result.loss == pytest.approx(manual / count, rel=1e-5)
    assert n_bytes == result.bytes == len("It barked 3 times.The cat sat on it.".encode())
    assert result.bits_per_byte == pytest.approx(manual / (n_bytes * math.log(2)), rel=1e-5)
    # A chat longer than the context is scored on what fits: its last answer, and only those bytes.
    long_chat = [user("Where is the cat?"), assistant("On the mat, " * 6), user("And the dog?"), assistant("Here.")]
    ids, answer = encode_conversation(tokenizer, long_chat)
    kept, kept_answer = fit_window(ids, answer, model.cfg.seq_len + 1)
    assert len(ids) > len(kept) and sum(kept_answer) < sum(answer)  # the first answer lost its start
    cropped = score(model, tokenizer, [long_chat])
    assert cropped.tokens == sum(kept_answer[1:])
    scored = [t for t, a in zip(kept[1:], kept_answer[1:]) if a and t != tokenizer.eos_token_id]  # targets
    assert cropped.bytes == len(tokenizer.decode(scored).encode())
    assert cropped.bytes < len(("On the mat, " * 6 + "Here.").encode())


def write_pairs(path: Path, rows: list) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_the_pairs_gate_counts_every_kind_of_bad_row(tmp_path):
    rows = [{"q": f"question {i}", "a": f"answer {i}"} for i in range(25)] + [
        {"q": "blank", "a": "   "},
        {"q": "no answer"},
        {"chat": [{"role": "user", "content": "hi"}]},
        {"q": 3, "a": "a number"},
        {"q": "x" * 300, "a": "too long a prompt"},
        {"chat": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
    ]
    cfg = FinetuneConfig(data=str(write_pairs(tmp_path / "pairs.jsonl", rows)), prompt_field="q", response_field="a",
                         messages_field="chat", max_prompt_chars=200)
    report = validate_pairs(load_pairs(cfg), cfg)
    failed = {r["name"]: r for r in report.results if not r["success"]}
    assert not report.success and report.n_rows == 31
    assert set(failed) == {"well-formed rows", "response present", "response not empty", "prompt length"}
    assert [failed[k]["unexpected_count"] for k in sorted(failed)] == [1, 1, 1, 2]
    assert failed["well-formed rows"]["examples"][0]["text"].startswith("line 28: the last message is not")
    assert "line 29: q is int" in failed["well-formed rows"]["examples"][1]["text"]
    assert "no 'a' (finetune.response_field)" in failed["response present"]["message"]
    assert "finetune.max_prompt_chars" in report.summary()
    # The good rows alone pass, the chat row included.
    good = rows[:25] + rows[-1:]
    cfg = cfg.model_copy(update={"data": str(write_pairs(tmp_path / "good.jsonl", good))})
    assert validate_pairs(load_pairs(cfg), cfg).success


def test_too_few_pairs_and_unreadable_lines_are_named(tmp_path):
    cfg = FinetuneConfig(data=str(write_pairs(tmp_path / "few.jsonl", [{"prompt": "q", "response": "a"}] * 5)))
    report = validate_pairs(load_pairs(cfg), cfg)
    assert not report.success and "5 pairs; at least 20 are needed (finetune.min_pairs)" in report.summary()
    bad = write_pairs(tmp_path / "bad.jsonl", [{"prompt": "q", "response": "a"}, '{"prompt": "q",'])
    with pytest.raises(PairsError, match=r"bad.jsonl line 2: not JSON"):
        load_pairs(FinetuneConfig(data=str(bad)))
    with pytest.raises(PairsError, match="finetune.data: .*missing.jsonl is not a file"):
        load_pairs(FinetuneConfig(data=str(tmp_path / "missing.jsonl")))


def test_the_embedded_pairs_ask_about_the_reference_and_hold_out_whole_answers():
    cfg = FinetuneConfig()
    pairs = load_pairs(cfg)
    assert validate_pairs(pairs, cfg).success and len(pairs) > 300
    assert pairs["prompt"][0] == 'What does the Python language reference say about the "assert" statement?'
    assert pairs["response"][0].startswith("Assert statements are a convenient way")
    train, val = split_pairs(pairs, cfg.val_fraction)
    assert 0.05 < len(val) / len(pairs) < 0.2
    assert not {c[-1]["content"] for c in train} & {c[-1]["content"] for c in val}
    assert split_pairs(pairs, cfg.val_fraction) == (train, val)  # the same split every time
    assert len(embedded_pairs()) == len(pairs)


def test_lora_trains_only_the_adapters_and_merges_into_plain_weights(assets, tmp_path):
    params = Params(paths={"finetune_checkpoint_dir": str(tmp_path / "ckpt"),
                           "finetune_plan": str(tmp_path / "plan.json")},
                    train={"precision": "fp32", "attention": "torch", "log_every": 2},
                    finetune={"max_steps": 24, "batch_size": 4, "warmup_steps": 1, "eval_every": 12, "lr": 0.02,
                              "lora": {"r": 4, "alpha": 8.0, "dropout": 0.0}})
    tokenizer = chat_tok(assets)
    chats = [[user(f"Where is cat {i}?"), assistant(f"Cat {i} sat on the mat.")] for i in range(16)]
    heldout = [[user(f"Where is cat {i}?"), assistant(f"Cat {i} sat on the mat.")] for i in range(16, 20)]
    base = Base("dir", str(assets / "model"), assets / "model", assets / "tokenizer",
                file_sha256(assets / "model" / "model.safetensors"))
    original = UltraThink.from_pretrained(assets / "model").state_dict()
    setup = build(params, base, tokenizer, chats, heldout, Distributed())
    trained, total = trainable_share(setup.trainer.model)
    cfg = setup.trainer.model.cfg  # r·(in + out) per adapted layer: q, k, v, o and the SwiGLU's three
    per_block = 4 * ((cfg.d_model + cfg.n_heads * cfg.head_dim) * 2 + 2 * (cfg.d_model + cfg.n_kv_heads * cfg.head_dim)
                     + 3 * (cfg.d_model + cfg.hidden))
    assert trained == per_block * cfg.n_layers and total == trained + sum(v.numel() for v in original.values())
    before = score(UltraThink.from_pretrained(assets / "model"), tokenizer, chats).loss
    result = setup.trainer.fit()
    assert result.step == 24 and [h["step"] for h in result.history if "val_loss" in h] == [12, 24]
    state = setup.trainer.model.state_dict()
    for key, value in original.items():  # every pretrained weight is bitwise unchanged under its adapter
        assert torch.equal(state[key.replace("_proj.weight", "_proj.base_layer.weight")], value), key
    assert any(state[k].abs().sum() > 0 for k in state if "lora_B" in k)
    adapted = setup.trainer.model.eval()
    x = torch.randint(0, 300, (2, 20))
    with torch.no_grad():
        expected = adapted(x).logits
        merged = setup.final_model().eval()
        assert torch.allclose(merged(x).logits, expected, atol=1e-5)
    assert set(merged.state_dict()) == set(original)  # plain UltraThink weights: loads, scores and exports as ever
    assert score(merged, tokenizer, chats).loss < before - 0.3  # it learned the answers it was trained on
    # The same configuration resumes from its checkpoint; other pairs are another configuration.
    assert build(params, base, tokenizer, chats, heldout, Distributed()).trainer.resume() == 24
    assert build(params, base, tokenizer, chats[1:], heldout, Distributed()).trainer.resume() is None


def test_fine_tuning_and_alignment_take_their_own_beta1_and_the_rest_from_train(assets, tmp_path):
    """β₁ is each stage's own, measured for it (finetune.beta1 0.9, align.beta1 0.8: benchmarks/README.md):
    pretraining's train.beta1 does not leak into them; β₂ and the rest of the optimizer are train.*'s."""
    params = Params(paths={"finetune_checkpoint_dir": str(tmp_path / "ckpt"),
                           "finetune_plan": str(tmp_path / "plan.json")},
                    train={"precision": "fp32", "attention": "torch", "beta1": 0.7, "beta2": 0.97},
                    finetune={"max_steps": 2, "warmup_steps": 1, "batch_size": 2, "beta1": 0.85})
    chats = [[user(f"Where is cat {i}?"), assistant(f"Cat {i} sat on the mat.")] for i in range(6)]
    base = Base("dir", str(assets / "model"), assets / "model", assets / "tokenizer",
                file_sha256(assets / "model" / "model.safetensors"))
    setup = build(params, base, chat_tok(assets), chats[:4], chats[4:], Distributed())
    betas = {group["betas"] for optimizer in setup.trainer.engine.optimizers for group in optimizer.param_groups}
    assert betas == {(0.85, 0.97)}
    setup.trainer.fit()  # a changed finetune.beta1 is another configuration: it does not resume this one's checkpoint
    assert build(params, base, chat_tok(assets), chats[:4], chats[4:], Distributed()).trainer.resume() == 2
    changed = params.model_copy(update={"finetune": params.finetune.model_copy(update={"beta1": 0.8})})
    assert build(changed, base, chat_tok(assets), chats[:4], chats[4:], Distributed()).trainer.resume() is None
    assert post_training_config(params.train, FinetuneConfig()).beta1 == 0.9
    assert post_training_config(params.train, AlignConfig()).beta1 == 0.8
    assert post_training_config(params.train, AlignConfig(beta1=0.6)).beta2 == 0.97


@pytest.mark.parametrize("mode, share", [("int8", 0.30), ("nf4", 0.20)])
def test_lora_on_a_quantized_base_trains_resumes_and_merges_into_a_plain_model(assets, tmp_path, mode, share):
    params = Params(paths={"finetune_checkpoint_dir": str(tmp_path / "ckpt"),
                           "finetune_plan": str(tmp_path / "plan.json")},
                    train={"precision": "fp32", "attention": "torch", "log_every": 2},
                    finetune={"max_steps": 24, "batch_size": 4, "warmup_steps": 1, "eval_every": 12, "lr": 0.02,
                              "quantize": mode, "lora": {"r": 4, "alpha": 8.0, "dropout": 0.0}})
    tokenizer = chat_tok(assets)
    chats = [[user(f"Where is cat {i}?"), assistant(f"Cat {i} sat on the mat.")] for i in range(16)]
    heldout = [[user(f"Where is cat {i}?"), assistant(f"Cat {i} sat on the mat.")] for i in range(16, 20)]
    base = Base("dir", str(assets / "model"), assets / "model", assets / "tokenizer",
                file_sha256(assets / "model" / "model.safetensors"))
    setup = build(params, base, tokenizer, chats, heldout, Distributed())
    fp32_bytes, quantized_bytes = setup.quantized
    assert quantized_bytes < share * fp32_bytes  # int8 ≈ a quarter, nf4 ≈ an eighth (plus scales)
    before = score(UltraThink.from_pretrained(assets / "model"), tokenizer, chats).loss
    result = setup.trainer.fit()
    assert result.step == 24
    adapted = setup.trainer.model.eval()
    x = torch.randint(0, 300, (2, 20))
    with torch.no_grad():
        expected = adapted(x).logits
        merged = setup.final_model().eval()
        assert (merged(x).logits - expected).abs().max() < 1e-3  # the dequantized base plus each update
    assert all(type(p) is torch.nn.Parameter for p in merged.parameters())  # a plain model again
    after = score(merged, tokenizer, chats).loss
    assert after < before - 0.3, (before, after)
    saved = [load_file(f) for f in (tmp_path / "ckpt").rglob("model.safetensors")]
    assert saved and all(any("lora_A" in k for k in w) for w in saved)
    assert not any("q_proj.base_layer" in k for w in saved for k in w)  # the frozen quantized weights stay out
    resumed = build(params, base, tokenizer, chats, heldout, Distributed())
    assert resumed.trainer.resume() == 24
    with torch.no_grad():
        assert torch.allclose(resumed.trainer.model.eval()(x).logits, expected, atol=1e-6)


def test_adapters_on_missing_layers_name_the_layers_there_are(assets):
    with pytest.raises(AdapterError, match=r"finetune.lora.target_modules \['qkv'\].*named down_proj, gate_proj"):
        add_adapters(UltraThink.from_pretrained(assets / "model"), LoraSettings(target_modules=["qkv"]))


def test_the_export_renders_chats_as_the_model_was_trained(assets, tmp_path):
    exported = export_hf(assets / "model", assets / "chat", tmp_path / "hf")
    hf_tokenizer = AutoTokenizer.from_pretrained(exported, local_files_only=True)
    ids = hf_tokenizer.apply_chat_template(CHAT[:1], add_generation_prompt=True, return_dict=True)["input_ids"]
    prompt_ids = encode_conversation(chat_tok(assets), CHAT[:2])[0][: len(ids)]
    assert ids == prompt_ids and ids[-3:] != []
    assert hf_tokenizer.decode(ids) == "<|user|>\nWhere is the cat?<|endoftext|><|assistant|>\n"


@pytest.mark.spawns
def test_chat_answers_each_line_with_the_conversation_so_far(assets):
    env_bin = Path(sys.executable).parent
    lines = "Where is the cat?\nAnd the dog?\n/reset\nAnd the dog?\n"
    done = subprocess.run([str(env_bin / "ultrathink"), "chat", "-m", str(assets / "model"), "--temperature", "0",
                           "--max-new-tokens", "6", "-p", str(assets / "none.yaml")], input=lines, text=True,
                          capture_output=True, cwd=assets)
    assert done.returncode == 1 and "not a chat model" in " ".join(done.stderr.split())  # no template: pretrained
    chat_dir = assets.parent / "chat_model"
    (chat_dir / "model").mkdir(parents=True, exist_ok=True)
    for f in (assets / "model").iterdir():
        (chat_dir / "model" / f.name).write_bytes(f.read_bytes())
    save_chat_tokenizer(assets / "tokenizer", chat_dir / "tokenizer")
    done = subprocess.run([str(env_bin / "ultrathink"), "chat", "-m", str(chat_dir), "--temperature", "0",
                           "--max-new-tokens", "6", "-p", str(assets / "none.yaml")], input=lines, text=True,
                          capture_output=True, cwd=assets)
    assert done.returncode == 0, done.stderr
    model, tokenizer = UltraThink.from_pretrained(chat_dir / "model"), chat_tokenizer(assets / "tokenizer")
    first = reply(model, tokenizer, [user("Where is the cat?")], 6, 0.0, 50, 0, 1.0)
    second = reply(model, tokenizer, [user("Where is the cat?"), assistant(first), user("And the dog?")], 6, 0.0, 50,
                   0, 1.0)
    fresh = reply(model, tokenizer, [user("And the dog?")], 6, 0.0, 50, 0, 1.0)
    assert done.stdout == f"{first}\n{second}\n{fresh}\n"


def test_finetuned_name_must_differ_from_the_pretrained_one(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({"registry": {"finetuned_name": "ultrathink"}}))
    with pytest.raises(ValueError, match="registry.finetuned_name must differ"):
        load_params(path)
