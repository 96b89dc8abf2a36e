import copy
import json
import sys

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file

from e2e_helpers import copy_project, sh
from test_train import VOCAB, corpus, make_trainer
from ultrathink.data.tokens import load_split
from ultrathink.model import UltraThink
from ultrathink.model.kernels import AttentionKernel
from ultrathink.train.calibration import BETA_RANGE, OUTPUT_GAIN, ValidationLogits, fit_temperature, fold_temperature
from ultrathink.train.loader import eval_batches
from ultrathink.train.trainer import mean_loss


def corrupted(stream: np.ndarray, share: float, seed: int = 1) -> np.ndarray:
    """`stream` with `share` of its tokens replaced by random ones: text unlike the training stream, on which a
    model fitted to that stream is overconfident."""
    rng = np.random.default_rng(seed)
    out = stream.copy()
    hit = rng.random(len(out)) < share
    out[hit] = rng.integers(0, VOCAB, int(hit.sum()))
    return out


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """A model trained on a clean cycle of tokens until it predicts it with near certainty."""
    trainer = make_trainer(tmp_path_factory.mktemp("calibration"), 80)
    trainer.fit()
    return trainer.model


def folded(model: UltraThink, temperature: float) -> UltraThink:
    other = copy.deepcopy(model)
    other.load_state_dict(fold_temperature(model.state_dict(), temperature))
    return other


def val_loss(model, stream) -> float:
    return mean_loss(model, eval_batches(stream, model.cfg.seq_len, 4), "fp32")[0]


def test_the_temperature_fitted_on_shifted_text_is_its_loss_minimum(fitted):
    val = corrupted(corpus(600, seed=0), 0.05)
    calibration = fit_temperature(fitted, eval_batches(val, fitted.cfg.seq_len, 4), "fp32")
    assert calibration.temperature > 1.2  # overconfident on text it was not trained on
    assert calibration.loss_before == pytest.approx(val_loss(fitted, val), rel=1e-5)
    assert calibration.loss_after == pytest.approx(val_loss(folded(fitted, calibration.temperature), val), rel=1e-5)
    assert calibration.loss_after < calibration.loss_before - 0.05
    # Newton's steps inside a bracket: no worse than the best temperature of a fine grid, and within a thousandth.
    grid = [val_loss(folded(fitted, t), val) for t in np.linspace(1.0, 4.0, 61)]
    assert min(grid) - 0.001 <= calibration.loss_after <= min(grid) + 1e-6


def test_folding_divides_the_logits_by_the_temperature_and_leaves_the_model_given_alone(fitted):
    x = torch.from_numpy(corpus(600, seed=3)[:32].astype(np.int64)).view(2, 16)
    before = {k: v.clone() for k, v in fitted.state_dict().items()}
    fitted.eval()
    with torch.no_grad():
        expected = fitted(x).logits / 1.37
        got = folded(fitted, 1.37)(x).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(before[k], v) for k, v in fitted.state_dict().items())
    assert fold_temperature(before, 1.0) is before
    assert OUTPUT_GAIN in before


@pytest.mark.parametrize("scale, bound", [(0.01, BETA_RANGE[1]), (-0.01, BETA_RANGE[0])])
def test_a_minimum_past_the_search_range_ends_at_its_bound(scale, bound):
    """Logits that always rank the target first (last) lose less the sharper (flatter) they are: the loss keeps
    falling toward β's upper (lower) bound, and the search stops next to it, below its 1e-5 tolerance."""
    targets = torch.arange(64) % 8
    logits = scale * torch.nn.functional.one_hot(targets, 8).float()
    assert ValidationLogits(logits, targets).best_beta() == pytest.approx(bound, abs=1e-4)


def test_a_model_at_its_temperature_is_left_as_it_is(fitted):
    """Fitted again after folding, the temperature is 1 to within the search's tolerance; where the step
    would not lower the loss, the model is left exactly as it was (temperature 1.0, the same loss)."""
    val = corrupted(corpus(600, seed=0), 0.05)
    first = fit_temperature(fitted, eval_batches(val, fitted.cfg.seq_len, 4), "fp32")
    again = folded(fitted, first.temperature)
    second = fit_temperature(again, eval_batches(val, again.cfg.seq_len, 4), "fp32")
    assert second.temperature == pytest.approx(1.0, abs=1e-3)
    assert second.loss_after <= second.loss_before <= first.loss_after + 1e-6
    if second.temperature == 1.0:
        assert second.loss_after == second.loss_before


def test_the_train_stage_saves_the_calibrated_model_and_records_its_temperature(trained_project):
    """The shipped params calibrate: the model dir holds the trained weights with their logits divided by the
    fitted temperature, and the summary records the trained weights' loss at T = 1 and at that T. The saved
    weights' logits are compared in fp32, where folding is exact to rounding: under the run's bf16, rounding the
    folded gain moves the saved model's loss by as much as the temperature gains (1.7e-4 nats against 5.4e-4
    measured on one Python's embedded corpus), so its loss could not tell a right fold from a wrong one."""
    project = trained_project
    summary = json.loads((project / "artifacts/model/train_summary.json").read_text())
    calibration = summary["calibration"]
    temperature = calibration["temperature"]
    assert isinstance(temperature, float) and 0.5 <= temperature <= 2.0
    model = UltraThink.from_pretrained(project / "artifacts/model", device="cpu").eval()
    # The attention kernel the stage validated with: the plan picks it by timing (matmul or SDPA under bf16 here),
    # and the two round differently (1.3e-4 nats apart on one run's model).
    model.use_attention(AttentionKernel(**summary["plan"]["attention"]))
    trained = folded(model, 1.0 / temperature)
    train = yaml.safe_load((project / "params.yaml").read_text())["train"]
    val = np.asarray(load_split(project / "data/prepared", "val")[:])
    precision = summary["plan"]["precision"]

    def batches():
        return eval_batches(val, model.cfg.seq_len, train["batch_size"], train["eval_batches"])

    assert mean_loss(trained, batches(), precision)[0] == pytest.approx(calibration["loss_before"], abs=1e-5)
    fitted_on = ValidationLogits.of(trained, batches(), precision)
    assert fitted_on.loss(1.0 / temperature)[0] == pytest.approx(calibration["loss_after"], abs=1e-5)
    assert calibration["loss_after"] <= calibration["loss_before"]
    assert calibration["targets"] == len(fitted_on.targets) == min(
        len(val) - 1, train["eval_batches"] * train["batch_size"] * model.cfg.seq_len)
    x, _ = next(iter(batches()))
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, trained(x).logits / temperature)


@pytest.mark.spawns
def test_turning_calibration_off_resumes_the_finished_run_and_saves_the_weights_as_trained(trained_project, tmp_path):
    """train.calibrate is not part of the checkpoint's configuration (it changes no trained number): turned off
    after a run, the stage resumes that run's last checkpoint, trains no step, and writes the same weights with
    the temperature taken back out of the final norm."""
    project = copy_project(trained_project, tmp_path)
    model = project / "artifacts/model"
    before, summary = load_file(model / "model.safetensors"), json.loads((model / "train_summary.json").read_text())
    sh([sys.executable, "-m", "tasks.train", "--set", "train.calibrate=false"], project)
    after, again = load_file(model / "model.safetensors"), json.loads((model / "train_summary.json").read_text())
    run = json.loads((project / "reports/train_run.json").read_text())
    assert run["resumed_from"] == summary["steps"] == again["steps"]
    assert again["calibration"] is None
    assert [k for k in before if not torch.equal(before[k], after[k])] == ([OUTPUT_GAIN] if summary["calibration"][
        "temperature"] != 1.0 else [])
    torch.testing.assert_close(after[OUTPUT_GAIN], before[OUTPUT_GAIN] * summary["calibration"]["temperature"])
