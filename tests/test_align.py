"""Alignment's parts: the DPO/IPO/hinge losses and implicit rewards against a hand computation, the answers'
log-probabilities, the preference data's three JSONL forms and its gate, the embedded pairs, DPO through the real
Trainer with a frozen reference, and the preference yardstick."""

import json
import math
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch

from ultrathink.align.dpo import preference_loss
from ultrathink.align.preferences import (PreferencesError, embedded_preferences, is_held_out, load_preferences,
                                          split_preferences)
from ultrathink.align.train import build
from ultrathink.config import AlignConfig, ModelConfig, Params, TokenizerConfig
from ultrathink.data.validation import validate_preferences
from ultrathink.evaluate import PreferenceYardstick, read_yardstick
from ultrathink.finetune.lora import trainable_share
from ultrathink.finetune.pairs import embedded_pairs, load_pairs, split_pairs
from ultrathink.finetune.sft import Base
from ultrathink.hashing import file_sha256
from ultrathink.model import UltraThink
from ultrathink.model.chat import save_chat_tokenizer, user
from ultrathink.scoring import (IGNORE, answer_logprobs, pair_chats, pair_logprobs, score_conversations,
                                score_preferences)
from ultrathink.text_eval import ModelFiles
from ultrathink.tokenizer import load_tokenizer, train_tokenizer
from ultrathink.train.distributed import Distributed

TEXT = [f"Cat {i} sat on the mat. Cat {i} ran to the dog, which barked {i % 7} times." for i in range(300)]


def cat_pair(i: int) -> dict:
    return {"prompt": [user(f"Where is cat {i}?")], "chosen": f"Cat {i} ran to the dog.",
            "rejected": f"Cat {i} sat on the mat."}


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    """model/ (a tiny random model) and tokenizer/ (a BPE tokenizer with the chat template): a fine-tuned dir."""
    root = tmp_path_factory.mktemp("align")
    train_tokenizer(TEXT, TokenizerConfig(vocab_size=320), root / "plain")
    torch.manual_seed(0)
    model = UltraThink(ModelConfig(d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, seq_len=48, dropout=0.0),
                       len(load_tokenizer(root / "plain")))
    model.save_pretrained(root / "model")
    save_chat_tokenizer(root / "plain", root / "tokenizer")
    return root


@pytest.mark.parametrize("kind", ["sigmoid", "hinge", "ipo"])
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_the_preference_losses_and_rewards_equal_a_hand_computation(kind, beta):
    policy_c, policy_r = [-12.0, -30.5, -7.25], [-14.0, -29.0, -7.25]
    ref_c, ref_r = [-13.0, -31.0, -8.0], [-13.5, -28.0, -6.0]
    terms = preference_loss(*(torch.tensor(v, dtype=torch.float64) for v in (policy_c, policy_r, ref_c, ref_r)),
                            beta, kind)
    for i in range(3):
        h = (policy_c[i] - policy_r[i]) - (ref_c[i] - ref_r[i])
        expected = {"sigmoid": math.log(1 + math.exp(-beta * h)),  # −log σ(βh)
                    "hinge": max(0.0, 1 - beta * h),
                    "ipo": (h - 1 / (2 * beta)) ** 2}[kind]
        assert float(terms.losses[i]) == pytest.approx(expected, rel=1e-12)
        assert float(terms.chosen_rewards[i]) == pytest.approx(beta * (policy_c[i] - ref_c[i]))
        assert float(terms.rejected_rewards[i]) == pytest.approx(beta * (policy_r[i] - ref_r[i]))
        assert float(terms.margins[i]) == pytest.approx(beta * h)
    with pytest.raises(ValueError, match="unknown preference loss"):
        preference_loss(*(torch.zeros(1),) * 4, beta, "kto")


def test_the_loss_pulls_the_chosen_answer_up_and_the_rewards_carry_no_gradient():
    policy_c, policy_r = torch.tensor([-5.0], requires_grad=True), torch.tensor([-4.0], requires_grad=True)
    terms = preference_loss(policy_c, policy_r, torch.tensor([-5.0]), torch.tensor([-4.0]), 0.1)
    terms.losses.sum().backward()
    assert policy_c.grad.item() == pytest.approx(-0.05) and policy_r.grad.item() == pytest.approx(0.05)  # −β σ(0)
    assert not terms.chosen_rewards.requires_grad and not terms.margins.requires_grad


def test_answer_logprobs_sum_the_log_probabilities_of_the_targets_that_are_scored():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    targets = torch.tensor([[IGNORE, IGNORE, 3, 4, 10], [1, IGNORE, IGNORE, IGNORE, IGNORE]])
    logp = torch.log_softmax(logits, -1)
    expected = [logp[0, 2, 3] + logp[0, 3, 4] + logp[0, 4, 10], logp[1, 0, 1]]
    assert torch.allclose(answer_logprobs(logits, targets), torch.stack(expected))


def test_a_pairs_answer_log_probability_is_its_answer_loss_summed(assets):
    """pair_logprobs and the fine-tuning yardstick (score_conversations) read the same answer tokens."""
    model, tokenizer = UltraThink.from_pretrained(assets / "model"), load_tokenizer(assets / "tokenizer")
    pairs = [cat_pair(i) for i in range(5)]
    chosen, rejected = pair_logprobs(model, tokenizer, pairs, batch_size=2)
    for answers, chats in zip((chosen, rejected), pair_chats(pairs)):
        scored = score_conversations(model, tokenizer, chats)
        assert float(answers.sum()) == pytest.approx(-scored.loss * scored.tokens, rel=1e-5)


def align_params(tmp_path: Path, **align) -> Params:
    return Params(paths={"align_checkpoint_dir": str(tmp_path / "ckpt"), "align_plan": str(tmp_path / "plan.json")},
                  train={"precision": "fp32", "attention": "torch", "log_every": 1},
                  align={"max_steps": 30, "batch_size": 8, "warmup_steps": 2, "eval_every": 15, "lr": 0.01,
                         "beta": 0.5, "lora": {"r": 4, "alpha": 8.0, "dropout": 0.0}, **align})


def test_dpo_through_the_trainer_learns_the_held_out_preference_from_a_frozen_reference(assets, tmp_path):
    """Pairs that prefer "ran to the dog" over "sat on the mat" for every cat: the held-out cats' chosen answers
    become the likelier ones. The reference is the model as it started (its log-probabilities, computed before
    the first step, are the base file's), the base weights stay bitwise unchanged under the adapters, and the
    same configuration resumes from its checkpoint while other pairs start afresh."""
    params, tokenizer = align_params(tmp_path), load_tokenizer(assets / "tokenizer")
    train, heldout = [cat_pair(i) for i in range(40)], [cat_pair(i) for i in range(40, 52)]
    base = Base("dir", str(assets), assets / "model", assets / "tokenizer", file_sha256(assets / "model" / "model.safetensors"))
    original = UltraThink.from_pretrained(assets / "model")
    before = score_preferences(original, tokenizer, heldout)
    setup, reference = build(params, base, tokenizer, train, heldout, Distributed())
    assert all(torch.equal(a, b) for a, b in zip(reference, pair_logprobs(original, tokenizer, heldout)))
    assert 0 < trainable_share(setup.trainer.model)[0] < sum(p.numel() for p in original.parameters())
    result = setup.trainer.fit()
    assert result.step == 30 and [h["step"] for h in result.history if "val_loss" in h] == [15, 30]
    state = setup.trainer.model.state_dict()
    for key, value in original.state_dict().items():
        assert torch.equal(state[key.replace("_proj.weight", "_proj.base_layer.weight")], value), key
    first, last = result.history[0], result.history[-1]
    assert first["step"] == 1 and first["train_loss"] == pytest.approx(math.log(2), abs=1e-5)  # −log σ(0): h = 0
    assert last["val_loss"] < 0.3
    aligned = setup.final_model().eval()
    after = score_preferences(aligned, tokenizer, heldout)
    assert before.accuracy < 0.5 and after.accuracy == 1.0 and after.loss_bits < before.loss_bits - 0.5
    terms = preference_loss(*pair_logprobs(aligned, tokenizer, heldout), *reference, 0.5)
    assert float((terms.margins > 0).double().mean()) == 1.0
    assert build(params, base, tokenizer, train, heldout, Distributed())[0].trainer.resume() == 30
    assert build(params, base, tokenizer, train[1:], heldout, Distributed())[0].trainer.resume() is None


def test_full_alignment_trains_every_weight_from_the_model_as_it_started(assets, tmp_path):
    params, tokenizer = align_params(tmp_path, method="full", max_steps=4, eval_every=4, lr=1e-3), load_tokenizer(assets / "tokenizer")
    pairs = [cat_pair(i) for i in range(12)]
    base = Base("dir", str(assets), assets / "model", assets / "tokenizer", file_sha256(assets / "model" / "model.safetensors"))
    original = UltraThink.from_pretrained(assets / "model")
    setup, reference = build(params, base, tokenizer, pairs[:8], pairs[8:], Distributed())
    assert setup.adapted is None
    assert trainable_share(setup.trainer.model) == (sum(p.numel() for p in original.parameters()),) * 2
    assert all(torch.equal(a, b) for a, b in zip(reference, pair_logprobs(original, tokenizer, pairs[8:])))
    setup.trainer.fit()
    trained = setup.final_model().state_dict()
    assert all(not torch.equal(trained[k], v) for k, v in original.state_dict().items() if k.endswith("proj.weight"))


def test_full_alignment_killed_after_a_checkpoint_resumes_to_the_uninterrupted_weights(assets, tmp_path):
    """A run stopped between its step-4 and step-8 checkpoints (the step-8 one never written), started again:
    it resumes at step 4 against the reference of the model as it started, not of the resumed weights, and ends
    on the weights and losses of the run that was never stopped."""
    params = align_params(tmp_path, method="full", max_steps=8, eval_every=4, lr=1e-3)
    tokenizer = load_tokenizer(assets / "tokenizer")
    pairs = [cat_pair(i) for i in range(16)]
    base = Base("dir", str(assets), assets / "model", assets / "tokenizer",
                file_sha256(assets / "model" / "model.safetensors"))
    whole = build(params, base, tokenizer, pairs[:12], pairs[12:], Distributed())[0].trainer
    uninterrupted = whole.fit()
    expected = {k: v.clone() for k, v in whole.model.state_dict().items()}
    shutil.rmtree(whole.checkpoints.latest().path)  # killed before step 8's checkpoint landed
    again = build(params, base, tokenizer, pairs[:12], pairs[12:], Distributed())[0].trainer
    assert again.resume() == 4
    resumed = again.fit()

    def losses(result) -> dict[int, float]:
        return {h["step"]: h["train_loss"] for h in result.history if "train_loss" in h}

    assert resumed.resumed_from == 4 and set(losses(resumed)) == set(range(1, 9))  # steps 1-4: the checkpoint's
    assert losses(resumed) == pytest.approx(losses(uninterrupted), rel=1e-6)
    state = again.model.state_dict()
    assert all(torch.allclose(state[k], v, rtol=0, atol=1e-6) for k, v in expected.items())


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_the_three_jsonl_forms_read_as_the_same_pair(tmp_path):
    q, good, bad = "Where is cat 3?", "Cat 3 ran to the dog.", "Cat 3 sat on the mat."
    rows = [{"prompt": q, "chosen": good, "rejected": bad},
            {"prompt": [user(q)], "chosen": [{"role": "assistant", "content": good}],
             "rejected": [{"role": "assistant", "content": bad}]},
            {"chosen": [user(q), {"role": "assistant", "content": good}],
             "rejected": [user(q), {"role": "assistant", "content": bad}]},
            {"q": q, "good": good, "bad": bad}]
    plain = load_preferences(AlignConfig(data=str(write_jsonl(tmp_path / "p.jsonl", rows[:3]))))
    assert plain["problem"].isna().all()
    assert [(r.prompt, r.chosen, r.rejected) for r in plain.itertuples()] == [([user(q)], good, bad)] * 3
    renamed = load_preferences(AlignConfig(data=str(write_jsonl(tmp_path / "r.jsonl", rows[3:])), prompt_field="q",
                                           chosen_field="good", rejected_field="bad"))
    assert (renamed.prompt[0], renamed.chosen[0], renamed.rejected[0]) == ([user(q)], good, bad)


def test_the_preference_gate_names_every_kind_of_bad_row(tmp_path):
    rows = [{"prompt": f"Where is cat {i}?", "chosen": f"Cat {i} ran.", "rejected": f"Cat {i} sat."} for i in range(25)]
    rows[2]["rejected"] = rows[2]["chosen"]
    rows[4]["chosen"] = "   "
    rows[6] = {"prompt": 7, "chosen": "a", "rejected": "b"}
    rows[8] = {"prompt": "q", "rejected": "b"}
    rows[10]["rejected"] = "x" * 50
    rows[12] = {"chosen": [user("q"), {"role": "assistant", "content": "a"}],
                "rejected": [user("other q"), {"role": "assistant", "content": "b"}]}
    cfg = AlignConfig(data=str(write_jsonl(tmp_path / "p.jsonl", rows)), max_answer_chars=40)
    gate = validate_preferences(load_preferences(cfg), cfg)
    assert not gate.success
    failed = {r["name"]: r for r in gate.results if not r["success"]}
    assert set(failed) == {"well-formed rows", "chosen present", "chosen not empty", "chosen differs from rejected",
                           "rejected length"}
    named = {name: [e["text"] for e in r["examples"]] for name, r in failed.items()}
    assert named["chosen differs from rejected"] == ["line 3: 'Where is cat 2?' → chosen 'Cat 2 ran.', rejected 'Cat 2 ran.'"]
    assert named["chosen not empty"][0].startswith("line 5: ")
    assert [t.split(":")[0] for t in named["well-formed rows"]] == ["line 7", "line 13"]
    assert "differ before their last message" in named["well-formed rows"][1]
    assert named["chosen present"][0].startswith("line 9: ") and named["rejected length"][0].startswith("line 11: ")
    assert "align.chosen_field" in failed["chosen present"]["message"]
    assert "align.max_answer_chars" in failed["rejected length"]["message"]
    few = AlignConfig(data=str(write_jsonl(tmp_path / "few.jsonl", rows[:3])))
    count = next(r for r in validate_preferences(load_preferences(few), few).results if r["name"] == "row count")
    assert not count["success"] and "align.min_pairs" in count["message"]


def test_unreadable_preference_files_name_the_file_and_line(tmp_path):
    with pytest.raises(PreferencesError, match="is not a file"):
        load_preferences(AlignConfig(data=str(tmp_path / "missing.jsonl")))
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "q", "chosen": "a", "rejected": "b"}, "{not json", "[1]"])
    with pytest.raises(PreferencesError, match=r"bad.jsonl line 2: not JSON"):
        load_preferences(AlignConfig(data=str(bad)))


def test_the_embedded_pairs_prefer_each_questions_own_answer_and_keep_the_held_out_answers_apart():
    cfg = AlignConfig()
    rows, questions = embedded_preferences(cfg.val_fraction), embedded_pairs()
    assert len(rows) == len(questions)
    for row, pair in zip(rows, questions):
        assert row["prompt"] == [user(pair["prompt"])] and row["chosen"] == pair["response"]
        assert row["rejected"] != row["chosen"]
        assert is_held_out(row["rejected"], cfg.val_fraction) == is_held_out(row["chosen"], cfg.val_fraction)
    # Each answer is rejected as often as it is chosen (but where a partner shared the answer and the next one
    # stood in: 2 of 406 here), so only its fit to the question is left to learn.
    chosen, rejected = Counter(r["chosen"] for r in rows), Counter(r["rejected"] for r in rows)
    assert chosen.keys() == rejected.keys() and sum((chosen - rejected).values()) <= len(rows) // 100
    frame = load_preferences(cfg)
    assert validate_preferences(frame, cfg).success
    train, heldout = split_preferences(frame, cfg.val_fraction)
    seen = {p[k] for p in train for k in ("chosen", "rejected")}
    assert heldout and not seen & {p[k] for p in heldout for k in ("chosen", "rejected")}
    fine_tuning_heldout = {c[-1]["content"] for c in split_pairs(load_pairs(Params().finetune), 0.1)[1]}
    assert fine_tuning_heldout <= {p["chosen"] for p in heldout}


def test_the_preference_yardstick_reads_back_and_scores_as_the_stage_does(assets):
    pairs = tuple(cat_pair(i) for i in range(6))
    yardstick = PreferenceYardstick(pairs)
    again = read_yardstick(yardstick.jsonl())
    assert isinstance(again, PreferenceYardstick) and again.documents == pairs and again.sha256 == yardstick.sha256
    assert yardstick.bytes == sum(len(p["chosen"]) + len(p["rejected"]) for p in pairs)
    model, tokenizer = UltraThink.from_pretrained(assets / "model"), load_tokenizer(assets / "tokenizer")
    expected = score_preferences(model, tokenizer, pairs)
    assert yardstick.score(ModelFiles(assets / "model", assets / "tokenizer"), "cpu") == pytest.approx(expected.loss_bits)
    chosen, rejected = pair_logprobs(model, tokenizer, pairs)
    gap = (chosen - rejected).double()
    assert expected.loss_bits == pytest.approx(float(torch.log2(1 + torch.exp(-gap)).mean()))
    assert expected.accuracy == float((gap > 0).double().mean()) and expected.pairs == 6


def test_aligned_name_must_differ_from_the_other_registered_names():
    with pytest.raises(ValueError, match="registry.aligned_name must differ"):
        Params(registry={"aligned_name": "ultrathink-chat"})
