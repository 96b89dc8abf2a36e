"""Warm start (train.init_from): a parent's weights (and, from a checkpoint, its optimizer state) start a new run;
a parent that does not fit stops the run before training, naming what differs."""

import shutil

import pytest
import torch

from test_train import FP, MODEL, VOCAB, make_trainer
from ultrathink.config import TokenizerConfig
from ultrathink.model import UltraThink
from ultrathink.tokenizer import tokenizer_hash, train_tokenizer
from ultrathink.train.checkpoint import Fingerprint
from ultrathink.train.sharded import OPTIMIZER_DIR
from ultrathink.train.warm_start import WarmStartError, check_optimizer, find_parent, load_parent_weights


@pytest.fixture
def trained(tmp_path):
    """A parent run of 10 steps: its checkpoint folder and its final model dir."""
    trainer = make_trainer(tmp_path / "parent", 10)
    trainer.fit()
    trainer.model.save_pretrained(tmp_path / "model")
    return trainer


def test_a_warm_start_continues_from_the_parent_weights(trained, tmp_path):
    parent = find_parent(trained.checkpoints.directory / "step_00000010", "step_00000010")
    assert parent.checkpoint is not None and len(parent.weights_sha256) == 16
    cold = make_trainer(tmp_path / "cold", 10, fingerprint=Fingerprint("p", "d", "c", "none"))
    warm = make_trainer(tmp_path / "warm", 10, fingerprint=Fingerprint("p", "d", "c", parent.weights_sha256))
    load_parent_weights(parent, warm.model, None)
    assert warm.validate() == pytest.approx(trained.validate(), rel=1e-6)  # exactly the parent's weights
    assert warm.fit().history[-1]["val_loss"] < cold.fit().history[-1]["val_loss"]


def test_optimizer_state_comes_from_a_checkpoint_of_the_same_optimizer(trained, tmp_path):
    parent = find_parent(trained.checkpoints.directory / "step_00000010", "ckpt")
    warm = make_trainer(tmp_path / "warm", 10, fingerprint=Fingerprint("p", "d", "c", parent.weights_sha256))
    load_parent_weights(parent, warm.model, None)
    warm.load_optimizer_from(check_optimizer(parent, "adamw"))
    theirs, ours = trained.engine.optimizers[0].state_dict(), warm.engine.optimizers[0].state_dict()
    assert all(torch.equal(theirs["state"][i]["exp_avg"], ours["state"][i]["exp_avg"]) for i in theirs["state"])
    with pytest.raises(WarmStartError, match="trained with optimizer adamw, this run uses lion"):
        check_optimizer(parent, "lion")
    with pytest.raises(WarmStartError, match="is a model, not a checkpoint"):
        check_optimizer(find_parent(tmp_path / "model", "artifacts/model"), "adamw")
    # A checkpoint whose optimizer state this version cannot read (an older UltraThink's, DeepSpeed's) says so.
    shutil.rmtree(parent.checkpoint.path / OPTIMIZER_DIR)
    with pytest.raises(WarmStartError, match=r"ckpt holds no optimizer state this version reads \(no optimizer/ "
                                             r"folder.*train.init_optimizer: false"):
        check_optimizer(parent, "adamw")


def test_another_architecture_fails_naming_the_tensors(trained, tmp_path):
    parent = find_parent(tmp_path / "model", "artifacts/model")
    wider = UltraThink(MODEL.model_copy(update={"d_model": 48}), VOCAB)
    with pytest.raises(WarmStartError, match=r"shapes differ \(parent vs this run\): blocks.0.attn.k_norm.weight "
                                             r"\(16,\) vs \(24,\), blocks.0.attn.k_proj.weight \(16, 32\) vs "
                                             r"\(24, 48\), .* and 20 more"):
        load_parent_weights(parent, wider, None)
    deeper = UltraThink(MODEL.model_copy(update={"n_layers": 3}), VOCAB)
    with pytest.raises(WarmStartError, match=r"tensors missing from the parent: blocks\.2\."):
        load_parent_weights(parent, deeper, None)
    # A model saved before q/k norms were the default: the error says which key makes this run match it.
    plain = UltraThink(MODEL.model_copy(update={"qk_norm": False}), VOCAB)
    with pytest.raises(WarmStartError, match=r"tensors this model lacks: .*q_norm.*set model.qk_norm: true\)"):
        load_parent_weights(parent, plain, None)
    plain.save_pretrained(tmp_path / "plain")
    with pytest.raises(WarmStartError, match=r"missing from the parent: .*k_norm.*set model.qk_norm: false\)"):
        load_parent_weights(find_parent(tmp_path / "plain", "old"), UltraThink(MODEL, VOCAB), None)


def test_another_tokenizer_fails_naming_the_vocabulary(trained, tmp_path):
    for name, text in (("tok_a", "alpha beta gamma delta " * 50), ("tok_b", "one two three four five " * 50)):
        train_tokenizer([text], TokenizerConfig(vocab_size=300), tmp_path / name)
    parent = find_parent(tmp_path / "model", "artifacts/model", tokenizer_dir=tmp_path / "tok_a")
    assert parent.tokenizer_sha256 == tokenizer_hash(tmp_path / "tok_a")
    model = UltraThink(MODEL, VOCAB)
    with pytest.raises(WarmStartError, match=r"another tokenizer than this run's \(parent vs this run: \d+ vs \d+ "
                                             r"tokens, \d+ ids differ \(id \d+: '.*' vs '.*'"):
        load_parent_weights(parent, model, tokenizer_hash(tmp_path / "tok_b"), tmp_path / "tok_b")
    load_parent_weights(parent, model, tokenizer_hash(tmp_path / "tok_a"), tmp_path / "tok_a")  # same: fine


def test_a_path_that_holds_no_model_is_named(tmp_path):
    with pytest.raises(WarmStartError, match="nowhere: not a model dir"):
        find_parent(tmp_path / "nowhere", "nowhere")


def test_the_parent_is_part_of_the_fingerprint():
    assert FP.id != Fingerprint(FP.params, FP.data, FP.code, "0123456789abcdef").id
