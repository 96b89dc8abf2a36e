"""train.ema_horizon: the weight average over the decaying steps, checked against torch's own EMA, kept only where it
validates better, carried through a resume, and refused where the ranks hold shards."""

import pytest
import torch
from pydantic import ValidationError
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from test_train import make_trainer, poison
from ultrathink.config import FinetuneConfig, TrainConfig
from ultrathink.finetune.sft import post_training_config
from ultrathink.train.averaging import EMA_HORIZON, decaying, ema_horizon_for


def test_the_average_is_torchs_ema_of_the_decaying_steps_only(tmp_path):
    """20 steps of WSD (2 of warmup) decaying over the last half of the 18 after warmup: steps 12-19 (0-based) run
    below the peak and are averaged, each update weighing the newest weights by 1 / (0.25 × 20), as
    torch.optim.swa_utils' EMA does with decay 0.8."""
    trainer = make_trainer(tmp_path, 20, decay_fraction=0.5, ema_horizon=0.25)
    reference = AveragedModel(trainer.model, multi_avg_fn=get_ema_multi_avg_fn(0.8), use_buffers=False)
    averaged = []
    while trainer.step < 20:
        step = trainer.step
        trainer.train_step()
        if decaying(step, trainer.cfg):
            reference.update_parameters(trainer.model)
            averaged.append(step)
        else:
            assert trainer.average.tensors is None  # nothing averaged at the peak rate
    assert averaged == list(range(12, 20))
    assert int(reference.n_averaged) == 8
    for ours, theirs, now in zip(trainer.average.tensors, reference.module.parameters(), trainer.model.parameters()):
        assert torch.allclose(ours, theirs, rtol=0, atol=1e-7)
    assert not all(torch.equal(ours, now) for ours, now in zip(trainer.average.tensors, trainer.model.parameters()))


def val_losses(trainer) -> tuple[float, float]:
    """The validation loss of the model's weights and of the average, measured apart."""
    selected = trainer.validate()
    trainer.average.swap()
    average = trainer.validate()
    trainer.average.swap()
    return selected, average


@pytest.mark.parametrize("settings, kept", [
    (dict(lr=3e-2, min_lr_ratio=0.9, decay_fraction=0.5, ema_horizon=0.2), True),  # noisy steps: the average is better
    (dict(lr=1e-2, decay_fraction=0.9, ema_horizon=0.9), False),  # mostly early, worse weights: it is not
])
def test_the_average_becomes_the_model_only_where_it_validates_better(tmp_path, settings, kept):
    trainer = make_trainer(tmp_path, 40, select="last", **settings)
    trainer.fit()
    selected = trainer.select_weights()
    weights_loss, average_loss = val_losses(trainer)
    assert (average_loss < weights_loss) is kept
    assert trainer.prefer_average(selected) is kept
    assert trainer.validate() == min(weights_loss, average_loss)


def test_the_average_costs_one_validation_pass_when_the_last_weights_are_kept(tmp_path):
    trainer = make_trainer(tmp_path, 20, select="last", decay_fraction=0.5, ema_horizon=0.2)
    trainer.fit()
    last_loss = trainer.history[-1]["val_loss"]
    assert trainer.history[-1]["step"] == trainer.select_weights() == 20
    passes, validate = [], trainer.validate
    trainer.validate = lambda: passes.append(validate()) or passes[-1]
    kept = trainer.prefer_average(20)
    assert len(passes) == 1 and kept is (passes[0] < last_loss)
    assert validate() == (passes[0] if kept else last_loss)


def test_a_skipped_non_finite_step_leaves_the_average_as_it_was(tmp_path):
    trainer = make_trainer(tmp_path, 20, decay_fraction=0.5, ema_horizon=0.25)
    poison(trainer, {15})  # the 15th step's forward: step 14 (0-based), inside the decay
    skipped = 0
    while trainer.step < 20:
        before = [t.clone() for t in trainer.average.tensors or []]
        if trainer.train_step() is None:
            skipped += 1
            assert before and all(torch.equal(a, b) for a, b in zip(before, trainer.average.tensors))
    assert skipped == 1 and all(torch.isfinite(t).all() for t in trainer.average.tensors)


def test_a_constant_rate_averages_nothing(tmp_path):
    trainer = make_trainer(tmp_path, 10, schedule="constant", ema_horizon=0.5)
    trainer.fit()
    assert trainer.average.tensors is None and trainer.prefer_average(trainer.select_weights()) is False


def test_a_resumed_run_ends_with_the_same_average_and_model(tmp_path):
    straight = make_trainer(tmp_path / "a", 20, decay_fraction=0.5, ema_horizon=0.2)
    straight.fit()
    straight_kept = straight.prefer_average(straight.select_weights())

    first = make_trainer(tmp_path / "b", 20, decay_fraction=0.5, ema_horizon=0.2)
    while first.step < 15:  # killed after its checkpoint at step 15, five steps into the average
        first.train_step()
    first.save_checkpoint()
    resumed = make_trainer(tmp_path / "b", 20, seed=99, decay_fraction=0.5, ema_horizon=0.2)
    assert resumed.resume() == 15 and resumed.average.tensors is not None
    resumed.fit()
    assert all(torch.equal(a, b) for a, b in zip(straight.average.tensors, resumed.average.tensors))
    assert resumed.prefer_average(resumed.select_weights()) == straight_kept
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name


def test_the_horizon_is_on_by_default_where_ranks_hold_whole_weights_and_refused_with_shards():
    assert ema_horizon_for(None, "single") == ema_horizon_for(None, "ddp") == EMA_HORIZON
    assert ema_horizon_for(None, "fsdp") == ema_horizon_for(None, "deepspeed") == 0.0
    assert ema_horizon_for(0.0, "single") == 0.0 and ema_horizon_for(0.3, "ddp") == 0.3
    for backend in ("fsdp", "deepspeed"):
        assert TrainConfig(backend=backend, ema_horizon=0).ema_horizon == 0
        with pytest.raises(ValidationError, match=f"ema_horizon is not supported with backend {backend}"):
            TrainConfig(backend=backend, ema_horizon=0.08)
    with pytest.raises(ValidationError, match="ema_horizon"):
        TrainConfig(ema_horizon=1.0)
    assert post_training_config(TrainConfig(), FinetuneConfig()).ema_horizon == 0  # pretraining only
