"""train.budget (time, tokens, FLOPs → steps, recorded), model.size auto (sizing.py) and tokenizer vocab auto."""

import json
import math
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from e2e_helpers import ROOT, client_for, make_project, set_params, sh
from ultrathink.config import Budget, ModelConfig, Params, ParamsError, TokenizerConfig, TrainConfig, load_params
from ultrathink.data.packing import training_texts
from ultrathink.stages import tokenizer as tokenizer_stage
from ultrathink.tokenizer import auto_vocab_size, load_tokenizer, precision_matters, train_tokenizer
from ultrathink.train import sizing
from ultrathink.train.budget import (COMPILE_PAYS_AFTER_SECONDS, PROBE_STEPS, Probe, checkpoints_apart,
                                     compile_pays, step_seconds_side_by_side, steps_for, warmup_for)
from ultrathink.train.loader import ContextWarmup
from ultrathink.train import plan as plan_module
from ultrathink.train import precision as precision_module
from ultrathink.train.plan import Decided, Plan, apply_plan, decide, plan_run

AUTO_SHAPE = {k: None for k in sizing.SHAPE_KEYS}


@pytest.mark.parametrize("text, expected", [
    ("2min", ("seconds", 120.0)), ("90s", ("seconds", 90.0)), ("1.5h", ("seconds", 5400.0)),
    (" 30 s ", ("seconds", 30.0)), ("2e7tokens", ("tokens", 2e7)), ("1e15flops", ("flops", 1e15)),
])
def test_budgets_parse_with_their_units(text, expected):
    assert tuple(Budget.parse(text)) == expected


@pytest.mark.parametrize("text", ["2 minutes", "120", "-5s", "0s", "1e15 FLOP", "fast"])
def test_a_bad_budget_names_the_key_and_the_forms(tmp_path, text):
    with pytest.raises(ParamsError) as exc:
        (tmp_path / "params.yaml").write_text("{}")
        load_params(tmp_path / "params.yaml", [f"train.budget={text}"])
    message = str(exc.value)
    assert "train.budget" in message and ("2min" in message or "positive" in message)


def test_size_auto_needs_a_budget_and_manual_fills_the_shape():
    with pytest.raises(ValueError, match="train.budget"):
        Params(model={"size": "auto"})
    manual = Params(model=AUTO_SHAPE, train={"batch_size": None})
    assert (manual.model.d_model, manual.model.n_layers, manual.model.seq_len, manual.train.batch_size) == (
        192, 4, 128, 16)
    auto = Params(model={"size": "auto", **AUTO_SHAPE, "d_model": 256}, train={"budget": "1min"})
    assert auto.model.d_model == 256 and auto.model.n_layers is None and auto.train.batch_size is None


def test_tokens_and_flops_budgets_divide_exactly():
    cfg = TrainConfig(eval_every=10, checkpoint_every=10)
    assert steps_for(Budget.parse("1000tokens"), 128, 50, cfg, None) == 8  # ceil(1000 / 128)
    assert steps_for(Budget.parse("1024tokens"), 128, 50, cfg, None) == 8
    assert steps_for(Budget.parse("6.4e5flops"), 128, 50, cfg, None) == 100  # 6.4e5 / (50 × 128)


def test_a_time_budget_pays_for_probe_first_steps_validation_with_its_best_checkpoint_and_checkpoints_apart():
    probe = Probe(step_seconds=0.1, first_steps_extra=1.0, eval_seconds=0.5, save_seconds=0.4, seconds=2.0)
    # An improving validation writes the best checkpoint too: 0.5 + 0.4 = 0.9 s each. A periodic checkpoint on a
    # validation step links that best (Trainer.fit) and costs nothing, the last step's included:
    # 60 s − 2 (probe) − 1 (first steps) − 0.9 (final validation) = 56.1 s left.
    assert probe.validation_seconds == pytest.approx(0.9)
    # Every checkpoint (every 20 steps) on a validation step (every 10): each step 0.1 + 0.9/10 = 0.19 s → 295.
    on_validation = TrainConfig(eval_every=10, checkpoint_every=20)
    assert checkpoints_apart(on_validation) == 0
    assert steps_for(Budget.parse("1min"), 128, 50, on_validation, probe) == 295
    # Every 15 steps: every other one falls between validations (15, 45, ...) and is written: each step
    # 0.1 + 0.09 + 0.4 × ½ / 15 = 0.2033 s → 275.
    half_apart = TrainConfig(eval_every=10, checkpoint_every=15)
    assert checkpoints_apart(half_apart) == pytest.approx(0.5)
    assert steps_for(Budget.parse("1min"), 128, 50, half_apart, probe) == 275
    assert checkpoints_apart(TrainConfig(eval_every=30, checkpoint_every=100)) == pytest.approx(2 / 3)  # all but 300


def test_compile_auto_compiles_once_the_measured_eager_run_outlasts_what_a_compile_costs_on_the_device():
    """On a GPU a cold compile cost 14-38 s and made the step 1.6-1.9x faster (H200); on a 2-core CPU 34-40 s for
    1.1-1.45x (benchmarks/README.md): three minutes of eager steps compile on a GPU and not on a CPU."""
    auto, dense = TrainConfig(budget="5min"), ModelConfig()
    probe = Probe(step_seconds=0.1, first_steps_extra=1.0, eval_seconds=0.5, save_seconds=0.4, seconds=2.0)
    assert COMPILE_PAYS_AFTER_SECONDS == {"cpu": 600, "cuda": 120}
    assert [compile_pays(auto, dense, 1800, probe, device) for device in ("cuda", "cuda:1", "cpu", "mps")] == \
        [True, True, False, False]  # 180 s of eager steps; a device type without figures goes by the CPU's
    assert [compile_pays(auto, dense, steps, probe, "cuda") for steps in (1199, 1200)] == [False, True]
    assert [compile_pays(auto, dense, steps, probe, "cpu") for steps in (5999, 6000)] == [False, True]
    assert not compile_pays(auto, dense, 10**6, None, "cuda")  # nothing measured, nothing decided: eager
    # Kept as set; never for routing variants (their shapes change every step) nor under DeepSpeed.
    assert compile_pays(TrainConfig(compile=True), dense, 1, probe, "cpu")
    assert not compile_pays(TrainConfig(compile=False), dense, 10**6, probe, "cuda")
    assert not compile_pays(auto, ModelConfig(moe={"enabled": True}), 10**6, probe, "cuda")
    assert not compile_pays(auto.model_copy(update={"backend": "deepspeed"}), dense, 10**6, probe, "cuda")
    # The plan decides it for the run's device: the same 5-minute plan (~270 s of eager steps) compiles on a GPU only.
    plans = {device: decide(dense, auto.model_copy(update={"precision": "fp32", "attention": "torch"}), 64,
                            _stream(), device, 1, {"fp32": 100.0, "bf16": 50.0}, lambda model, train, kernel: probe)
             for device in ("cuda", "cpu")}
    assert plans["cuda"].max_steps == plans["cpu"].max_steps and plans["cuda"].max_steps * 0.1 > 120
    assert (plans["cuda"].compile, plans["cpu"].compile) == (True, False)


def test_a_gpu_spends_a_budget_its_model_cannot_use_on_twice_the_steps(monkeypatch):
    """A small model's step on a GPU takes about as long at half the batch (an H200: 63 against 62 ms), and where a
    budget bought more tokens than the model could use, half the batch measured better there at 2 minutes
    (benchmarks/README.md): such a plan gets half the batch on a GPU, measured before it is taken. A plan the budget
    binds keeps its batch, and any other device type is planned as a CPU is."""
    def plans(budget: str, probe=None, batch_size=None, world_size=1) -> tuple[Plan, Plan]:
        train_cfg = TrainConfig(budget=budget, batch_size=batch_size, precision="bf16", attention="torch",
                                compile=False)
        return tuple(decide(ModelConfig(size="auto"), train_cfg, 448, _stream(200_000), device, world_size, None,
                            probe or (lambda *_: pytest.fail("a FLOPs budget without compile auto probes nothing")))
                     for device in ("cuda", "cpu"))

    # A FLOPs budget buys the same tokens at any batch: half the batch is twice the steps.
    gpu, cpu = plans("1e15flops")  # more tokens than the model can use
    assert (gpu.sizing["shape"], gpu.sizing["tokens"]) == (cpu.sizing["shape"], cpu.sizing["tokens"])
    assert (gpu.sizing["batch_size"], cpu.sizing["batch_size"]) == (8, 16)
    assert gpu.max_steps == pytest.approx(2 * cpu.max_steps, abs=1)
    gpu, cpu = plans("1e13flops")  # 9 epochs: the budget binds
    assert (gpu.sizing["batch_size"], gpu.max_steps) == (cpu.sizing["batch_size"], cpu.max_steps)
    assert gpu.sizing["batch_size"] > sizing.MIN_BATCH  # a batch that could have been halved
    # The user's next moves: a batch set in params.yaml is kept; a job on 8 GPUs halves its global batch of 16
    # (a sequence per rank), one on 16 cannot split 8 sequences over its ranks and keeps 16.
    assert [p.sizing["batch_size"] for p in plans("1e15flops", batch_size=16)] == [16, 16]
    assert [plans("1e15flops", world_size=ranks)[0].sizing["batch_size"] for ranks in (8, 16)] == [8, 16]

    # A time budget: a GPU-like step, 60 ms at any batch, and both devices given a GPU's peak. The smaller batch is
    # probed; it buys half the tokens in as many steps.
    monkeypatch.setattr(plan_module, "peak_for", lambda precision, device, gflops: 1e15)

    def flat_step(model_cfg, train_cfg, kernel) -> Probe:
        return Probe(step_seconds=0.06, first_steps_extra=1.0, eval_seconds=0.3, save_seconds=0.2, seconds=1.0)

    gpu, cpu = plans("2min", flat_step)
    assert gpu.sizing["shape"] == cpu.sizing["shape"]
    assert (gpu.sizing["batch_size"], cpu.sizing["batch_size"]) == (8, 16)
    assert (gpu.sizing["measured"][-1]["why"], gpu.sizing["measured"][-1]["batch_size"]) == \
        ("spare seconds: a smaller batch", 8)  # dropout kept at the bound, at no cost: not sized again
    assert gpu.sizing["tokens"] == pytest.approx(cpu.sizing["tokens"] / 2, rel=0.05)
    assert gpu.max_steps == pytest.approx(cpu.max_steps, rel=0.05)
    gpu, cpu = plans("12s", flat_step)  # the seconds bind
    assert gpu.sizing == cpu.sizing
    assert not any(m["why"].startswith("spare seconds") for m in gpu.sizing["measured"])


def test_warmup_follows_the_steps_when_given_as_a_fraction():
    assert warmup_for(400, TrainConfig(warmup_fraction=0.05)) == 20
    assert warmup_for(5, TrainConfig(warmup_fraction=0.1)) == 1  # a tenth of few steps still warms up one
    assert warmup_for(400, TrainConfig(warmup_steps=30)) == 30
    assert warmup_for(10, TrainConfig(warmup_steps=30, budget="1min")) == 10  # never more than the steps
    with pytest.raises(ValueError, match="warmup_steps"):
        TrainConfig(warmup_steps=30, max_steps=10)


def test_effective_tokens_discount_repeats():
    unique = 1e6
    assert sizing.effective_tokens(5e5, unique) == 5e5
    assert sizing.effective_tokens(1e6, unique) == 1e6
    four = sizing.effective_tokens(4e6, unique)
    assert four == pytest.approx(unique * (1 + sizing.REPEAT_DECAY * (1 - math.exp(-3 / sizing.REPEAT_DECAY))))
    assert 3e6 < four < 3.5e6  # four epochs are worth about 3.4 of fresh text (R* 6)
    assert sizing.effective_tokens(1e9, unique) == pytest.approx(unique * (1 + sizing.REPEAT_DECAY))  # saturates


def test_the_repeat_discount_is_the_one_the_measured_sweeps_fit(monkeypatch):
    """REPEAT_DECAY is fitted to shapes trained side by side for the same seconds (sizing_evidence.SWEEPS): with it
    the law prefers, on every sweep, the shape that measured best or one within the run-to-run spread; with
    Muennighoff's published 15.4 it prefers the smaller model, which measured worse by more than the spread. A
    shape counts by its repeats' means: judged run by run, a law that picks the repeat with the most tokens (the
    worst of three at 5 minutes on tiny Shakespeare) would be credited or blamed for the machine's noise. Nor does
    the fit follow a difference smaller than one run's noise, the machine's share and the seed's: the 21 sweeps of
    November 2026 preferred R* 6 by less than that and fitted 5; with nine under the recipe of December (the
    weight average, β₁ 0.8, the output's temperature, the budget's vocabulary) R* 6 leads by twice the noise."""
    from ultrathink.train import sizing_evidence
    from ultrathink.train.sizing_evidence import (SWEEPS, Measured, Run, Seeds, Sweep, fit_repeat_decay, noise,
                                                  run_spread, seed_spread)

    spread = 0.03  # bits/byte between runs of one configuration at 2 min (benchmarks/README.md)
    assert sizing.REPEAT_DECAY == fit_repeat_decay() == 6.0
    assert 0.005 < run_spread() < 0.015 and 0.005 < seed_spread() < 0.015
    assert noise() == pytest.approx(math.hypot(run_spread(), seed_spread()))
    assert seed_spread((Seeds("c", "x", (1.0, 1.02)), Seeds("c", "y", (2.0, 2.01, 2.03)), Seeds("c", "z", (3.0,)))) \
        == pytest.approx(math.sqrt((0.0002 + 0.0014 / 3) / 3))  # pooled over x and y; one seed says nothing
    november = tuple(sweep for sweep in SWEEPS if "2026-12" not in sweep.budget)
    assert len(november) == 21
    assert fit_repeat_decay(november) == 5.0
    monkeypatch.setattr(sizing_evidence, "noise", lambda sweeps=SWEEPS: 0.0)
    assert fit_repeat_decay(november) == 6.0  # to the last digit
    monkeypatch.setattr(sizing_evidence, "noise", lambda sweeps=SWEEPS: 0.03)
    assert fit_repeat_decay() == 5.0  # a noise this large would tie 5 with 6: the tie goes to the stronger discount
    monkeypatch.undo()
    twice = Sweep("corpus", "2min", 1_000_000, (Run("a", 1, 1, 2.00), Run("a", 1, 1, 2.02), Run("b", 2, 1, 1.00),
                                                Run("b", 2, 1, 1.00), Run("b", 2, 1, 1.03), Run("c", 3, 1, 1.5)))
    assert run_spread((twice,)) == pytest.approx(math.sqrt((0.0002 + 2 * 0.0003) / 3))  # pooled over a and b
    assert run_spread((Sweep("corpus", "2min", 1_000_000, (Run("a", 1, 1, 2.0), Run("b", 2, 1, 1.9))),)) == 0.0
    # Every sweep within the spread but two, small corpora at a budget large beside them, where a shape smaller than
    # the law's pick measured best (the test below: no bound on parameters per token fixes them without a miss
    # elsewhere).
    missed = [sweep.corpus for sweep in SWEEPS if sweep.regret(sizing.REPEAT_DECAY) > spread]
    assert missed == ["tiny Shakespeare, first 100 KB (0.09 MB, vocab 320)",
                      "Pride and Prejudice, ntoll's copy, first 100 KB (0.09 MB, vocab 320)"]
    assert any(sweep.regret(15.4) > spread for sweep in SWEEPS)

    repeated = Sweep("corpus", "5min", 1_000_000, (Run("small", 1_000_000, 3_000_000, 2.30),
                                                   Run("small", 1_000_000, 2_000_000, 2.10),
                                                   Run("large", 2_000_000, 1_500_000, 2.15)))
    assert repeated.shapes() == (Measured("small", 1_000_000, 2_500_000, pytest.approx(2.20), 2),
                                 Measured("large", 2_000_000, 1_500_000, 2.15, 1))
    assert repeated.regret(1.0) == 0.0  # a strong discount: the larger model, better than small's mean
    assert repeated.pick(100.0).shape == "small" and repeated.regret(100.0) == pytest.approx(0.05)


def test_the_parameters_the_law_credits_stop_where_the_measured_runs_stop():
    """MEASURED_PARAMS_PER_TOKEN is the most parameters per unique token at which a shape measured best in a sweep:
    beyond it the law would extrapolate. It changes one pick on the sweeps, between two shapes that measured alike.
    No bound, looser or tighter, keeps every sweep within the spread: on a small corpus a larger model paid on
    WikiText-2 and not on tiny Shakespeare or Pride."""
    from ultrathink.train.sizing_evidence import SWEEPS, GRID, params_per_token_edge

    spread = 0.03
    bound, rstar = sizing.MEASURED_PARAMS_PER_TOKEN, sizing.REPEAT_DECAY
    assert bound == params_per_token_edge() == 64
    moved = [sweep for sweep in SWEEPS if sweep.pick(rstar, bound) != sweep.pick(rstar, math.inf)]
    assert [sweep.corpus for sweep in moved] == ["tiny Shakespeare, first 100 KB (0.09 MB, vocab 320)"]
    assert moved[0].regret(rstar, bound) == pytest.approx(moved[0].regret(rstar, math.inf), abs=0.001)
    for cap in (2.0, 4.0, 6.0, 8.0, 10.0, 15.0, 20.0, 30.0, 40.0, bound, math.inf):
        assert any(sweep.regret(rstar, cap) > spread for sweep in SWEEPS), cap
    assert all(any(sweep.regret(decay, bound) > spread for sweep in SWEEPS) for decay in GRID)  # nor another R*

    assert sizing.useful_params(1_000_000, 100_000) == 1_000_000
    assert sizing.useful_params(10_000_000, 100_000) == bound * 100_000


def test_a_budget_far_beyond_the_corpus_picks_a_model_the_corpus_can_train_and_never_a_smaller_one():
    """A corpus of 50,000 tokens and budgets from what it needs to 10,000 times more (a GPU beside a small text): the
    model grows with the budget until the parameters the law credits run out, then stays, and a larger budget never
    picks a smaller model."""
    auto = ModelConfig(size="auto", dropout=0.0)
    unique = 50_000
    chosen = [sizing.choose(auto, 320, unique, flops=10 ** (e / 4)) for e in range(48, 69)]  # 1e12 … 1e17
    params = [s.non_embedding_params for s in chosen]
    assert params == sorted(params) and params[0] < params[-1]
    # Past the cap a shape is credited no more, and sees fewer tokens: nothing beyond the first shape past it wins.
    credited = sizing.MEASURED_PARAMS_PER_TOKEN * unique
    first_past = min(n for n in (sizing.counts(c, auto, 320)[1] for c in sizing.candidate_shapes({})) if n >= credited)
    assert params[-1] <= first_past
    assert params.count(params[-1]) > 5  # it stays there over the largest budgets


def test_a_budget_past_what_the_corpus_can_use_is_left_unspent():
    """Past sizing.saturating_tokens the law predicts less than TIE more (about 22 epochs at R* 6; later with
    dropout, whose repeats keep more of their worth), and runs lost there: a compute or time budget's tokens stop at
    them, the batch is sized for those, and the rest of the budget is left unspent. A tokens budget is the user's
    and is spent whole; a budget the corpus can use is spent whole too."""
    unique = 50_000
    for params in (1e6, 3e6, 3e7):
        tokens = sizing.saturating_tokens(params, unique)
        floor = sizing.predicted_loss(params, math.inf, unique)
        assert (sizing.predicted_loss(params, tokens, unique) <= floor * (1 + sizing.TIE)
                < sizing.predicted_loss(params, 0.97 * tokens, unique))
        assert 20 < tokens / unique < 25
        assert sizing.saturating_tokens(params, unique, sizing.DROPOUT_REPEAT_DECAY) > 2.5 * tokens
    auto = ModelConfig(size="auto", dropout=0.0)
    huge = sizing.choose(auto, 320, unique, flops=1e17)
    assert huge.tokens == pytest.approx(sizing.saturating_tokens(huge.non_embedding_params, unique))
    assert huge.epochs == pytest.approx(huge.tokens / unique) and huge.epochs < 25
    assert huge.batch_size == sizing.batch_for(huge.tokens, huge.shape.seq_len) < \
        sizing.batch_for(1e17 / huge.flops_per_token, huge.shape.seq_len)
    timed = sizing.at_measured_speed(huge, unique, seconds=3600, seconds_per_token=1e-6, dropout=0.0)
    assert timed.tokens == pytest.approx(huge.tokens)  # 3.6e9 tokens bought, 22 epochs' worth trained
    dropped = sizing.at_measured_speed(huge, unique, seconds=3600, seconds_per_token=1e-6, dropout=0.1)
    assert dropped.tokens == pytest.approx(sizing.saturating_tokens(huge.non_embedding_params, unique,
                                                                    sizing.DROPOUT_REPEAT_DECAY))
    small = sizing.choose(auto, 320, unique, flops=1e12)
    assert small.tokens == pytest.approx(1e12 / small.flops_per_token) and small.epochs < 10
    assert sizing.choose(auto, 320, unique, tokens=1e8).tokens == 1e8


def test_a_time_plan_stops_its_steps_where_the_law_credits_no_more_and_says_so():
    """A time budget far beyond a small corpus (an hour at 2e10 FLOP/s for 20,000 tokens): the plan's steps are its
    step_ceiling, the tokens the sizing saturated at, its line says the rest is left unspent, and MLflow records the
    ceiling. A budget the corpus can use plans fewer steps than its ceiling and says nothing of it."""
    def planned(budget: str) -> Plan:
        train_cfg = TrainConfig(budget=budget, batch_size=None, precision="fp32", attention="torch", eval_batches=2)
        return _time_plan(ModelConfig(size="auto", dropout=0.0), train_cfg, _stream(), _probe_at_a_flop_rate([]))

    long, short = planned("1h"), planned("5s")
    assert long.max_steps == long.step_ceiling
    assert long.step_ceiling == math.ceil(long.sizing["tokens"] / long.tokens_per_step)
    assert 20 < long.max_steps * long.tokens_per_step / 20_000 < 25
    assert "the rest of the budget is left unspent" in Decided(long, True, {}, None, "").describe()
    assert long.mlflow_params()["plan.step_ceiling"] == long.step_ceiling
    assert "plan.step_ceiling" not in Plan("2min", 10, 1, 64, 1).mlflow_params()  # a shape of the user's: no bound
    assert short.max_steps < short.step_ceiling
    assert "unspent" not in Decided(short, True, {}, None, "").describe()


def test_sizing_grows_with_compute_and_keeps_fixed_keys():
    auto = ModelConfig(size="auto", dropout=0.0)
    chosen = [sizing.choose(auto, 512, 300_000, flops=c) for c in (1e12, 1e13, 1e14, 1e15)]
    params = [s.params for s in chosen]
    assert params == sorted(params) and params[-1] > 5 * params[0]
    for s in chosen:  # the winner: the cheapest of the candidates within TIE of the lowest predicted loss
        budget = s.tokens * s.flops_per_token
        rows = [(sizing.predicted_loss(sizing.counts(c, auto, 512)[1], budget / sizing.counts(c, auto, 512)[2],
                                       300_000), sizing.counts(c, auto, 512)[2]) for c in sizing.candidate_shapes({})]
        best = min(loss for loss, _ in rows)
        assert s.predicted_loss <= best * (1 + sizing.TIE)
        assert s.flops_per_token == min(cost for loss, cost in rows if loss <= best * (1 + sizing.TIE))
    # A corpus 100× larger lets the same compute go to more tokens of new text: a smaller model, fewer epochs.
    roomy = sizing.choose(auto, 512, 30_000_000, flops=1e15)
    assert roomy.params <= chosen[-1].params and roomy.epochs < chosen[-1].epochs
    fixed = sizing.choose(ModelConfig(size="auto", d_model=256, seq_len=64), 512, 300_000, flops=1e14)
    assert fixed.shape.d_model == 256 and fixed.shape.seq_len == 64 and fixed.shape.n_heads == 4
    tokens = sizing.choose(auto, 512, 300_000, tokens=2e7)  # Chinchilla's 20 tokens per parameter
    assert 0.5e6 < tokens.non_embedding_params < 2e6


def test_a_time_budget_sizes_by_each_shapes_own_seconds_per_token():
    """A step's memory-bound share (per layer × width) makes deep narrow shapes dearer than their FLOPs say: with
    it, the same seconds buy a wider, shallower model; more seconds never a smaller one; set keys still win."""
    auto, peak = ModelConfig(size="auto"), 4.4e11
    flop_only = sizing.StepCost(peak)
    memory_bound = sizing.StepCost.fitted(peak, sizing.Shape(64, 2, 1, 1, 64), 900_000, 14e-6)
    assert memory_bound.per_layer_width == pytest.approx((14e-6 - 900_000 / peak) / 128, rel=0.01)
    shape = sizing.Shape(128, 1, 2, 1, 128)
    assert memory_bound.seconds_per_token(shape, 1_700_000) == pytest.approx(
        1_700_000 / peak + memory_bound.per_layer_width * 128)
    plain, bound = (sizing.choose(auto, 512, 500_000, seconds=10, cost=c) for c in (flop_only, memory_bound))
    assert plain.shape.n_layers > bound.shape.n_layers == 1
    assert bound.shape.d_model / bound.shape.n_layers > plain.shape.d_model / plain.shape.n_layers
    for cost in (flop_only, memory_bound):
        chosen = [sizing.choose(auto, 512, 500_000, seconds=t, cost=cost) for t in (5, 10, 30, 120, 600, 3600)]
        params = [c.params for c in chosen]
        assert params == sorted(params) and params[-1] > 10 * params[0], params
    fixed = sizing.choose(ModelConfig(size="auto", n_layers=3), 512, 500_000, seconds=30, cost=memory_bound)
    assert fixed.shape.n_layers == 3
    # A measured step faster than the peak allows leaves no memory-bound share, not a negative one.
    assert sizing.StepCost.fitted(peak, shape, 1_700_000, 1e-9).per_layer_width == 0.0


def test_a_near_tie_in_sizing_goes_to_the_cheaper_shape_whatever_the_measured_rate():
    """Rates 3% apart (a busy core) used to flip the shape between near-tied candidates; within TIE the cheaper
    shape wins, and the rate is rounded to 2 figures before sizing sees it."""
    from ultrathink.train.sizing import round_figures

    auto = ModelConfig(size="auto", dropout=0.0)
    shapes = {sizing.choose(auto, 4096, 400_000, flops=round_figures(rate) * 120).shape
              for rate in (6.1e10, 6.2e10, 6.3e10)}
    assert len(shapes) == 1
    assert round_figures(61_234_567.0) == 61_000_000.0 and round_figures(0.0123456) == 0.012


def test_dropout_is_kept_where_the_law_predicts_it_pays_and_a_set_value_wins():
    """model.dropout null: 0 with a manual shape; with size auto, sizing.DROPOUT where the tokens it leaves, repeats
    discounted at DROPOUT_REPEAT_DECAY, are predicted to beat those without it by more than TIE: not for a few
    passes over the corpus, yes for many, never once a step with it costs too many tokens, and never less for more
    epochs. A number set in params.yaml is kept at any budget. All beside the base weight decay: beside the
    repeated-text one (set, or planned for many epochs) a model below DROPOUT_AT_BOUND_PARAMS_PER_TOKEN keeps none
    (the next tests: one above it keeps DROPOUT_AT_BOUND)."""
    assert Params(model=AUTO_SHAPE).model.dropout == 0.0
    auto, base = ModelConfig(size="auto"), sizing.WEIGHT_DECAY
    few, many = (sizing.choose(auto, 512, 300_000, flops=f, weight_decay=base) for f in (1e12, 4e14))
    assert few.epochs < 4 < 10 < many.epochs
    assert (few.dropout, many.dropout) == (0.0, sizing.DROPOUT)
    for decay in (None, sizing.REPEATED_WEIGHT_DECAY):  # null: many epochs plan the repeated-text decay
        beside = sizing.choose(auto, 512, 300_000, flops=1e14, weight_decay=decay)
        assert beside.epochs > 5 and beside.dropout == 0.0
        assert 10 * 300_000 < beside.non_embedding_params < sizing.DROPOUT_AT_BOUND_PARAMS_PER_TOKEN * 300_000
    assert many.tokens == pytest.approx(4e14 / many.flops_per_token)  # a FLOPs budget: dropout costs no tokens
    undropped = sizing.choose(ModelConfig(size="auto", dropout=0.0), 512, 300_000, flops=4e14)
    assert undropped.shape == many.shape and undropped.dropout == 0.0
    slower = sizing.with_dropout(undropped, 300_000, slowdown=1.25, weight_decay=base)
    assert undropped.epochs > 10  # null: the repeated decay, and (at the bound) its dropout
    assert undropped.non_embedding_params > sizing.DROPOUT_AT_BOUND_PARAMS_PER_TOKEN * 300_000
    assert sizing.with_dropout(undropped, 300_000, slowdown=1.25).dropout == sizing.DROPOUT_AT_BOUND
    assert slower.dropout == sizing.DROPOUT and slower.tokens == pytest.approx(undropped.tokens / 1.25)
    assert slower.epochs == pytest.approx(slower.tokens / 300_000)
    assert sizing.with_dropout(undropped, 300_000, 10.0, base) == undropped  # too dear: no dropout, same tokens
    assert sizing.with_dropout(undropped, 300_000, 0.8, base).tokens == undropped.tokens  # faster: noise, 1×
    # For one shape and slowdown, more epochs never turn dropout off.
    kept = [sizing.dropout_pays(undropped.non_embedding_params, e * 300_000, e * 300_000 / 1.3, 300_000)
            for e in (1, 2, 4, 6, 8, 12, 20, 50)]
    assert kept == sorted(kept) and not kept[0] and kept[-1]
    # A model with few parameters per unique token never keeps it, however many epochs (it did not overfit enough).
    small = 0.9 * sizing.DROPOUT_MIN_PARAMS_PER_TOKEN * 300_000
    assert not any(sizing.dropout_pays(small, e * 300_000, e * 300_000, 300_000) for e in (2, 10, 100))
    assert sizing.dropout_pays(small, 10 * 300_000, 10 * 300_000, 300_000, min_params_per_token=0.0)
    for level in (0.0, 0.2):
        assert sizing.choose(ModelConfig(size="auto", dropout=level), 512, 300_000, flops=4e14).dropout == level
        assert sizing.choose(ModelConfig(size="auto", dropout=level), 512, 300_000, flops=1e12).dropout == level
    model, _ = apply_plan(Plan("4e14flops", 10, 1, 64, 1, sizing=many.to_dict()), auto,
                          TrainConfig(budget="4e14flops", weight_decay=base))
    assert model.dropout == many.dropout and model.resolved and "dropout 0.1" in many.explain()
    old = {k: v for k, v in many.to_dict().items() if k != "dropout"}  # a plan recorded before dropout was sized
    assert "dropout" not in sizing.Sizing.from_dict(old).explain()
    before_measured = {k: v for k, v in many.to_dict().items() if k != "measured"}  # nor what a time plan probed
    assert sizing.Sizing.from_dict(before_measured).measured == [] and "measured" not in many.explain()


def test_dropouts_repeat_discount_is_the_one_the_measured_runs_fit():
    """DROPOUT_REPEAT_DECAY and DROPOUT_MIN_PARAMS_PER_TOKEN are fitted to runs of the law's shape with dropout
    beside runs without it (sizing_evidence.SWEEPS' dropped runs): with them the rule keeps the level that measured
    better on every sweep; with a smaller discount it drops dropout where it paid, with none (R*_D = R*) dropout could
    never pay, since it only costs tokens, and without the threshold the law keeps it on a small model where it
    measured worse."""
    from ultrathink.train.sizing_evidence import SWEEPS, fit_dropout, noise, total_dropout_regret

    spread = 0.03
    rstar, rstar_d, threshold = sizing.REPEAT_DECAY, sizing.DROPOUT_REPEAT_DECAY, sizing.DROPOUT_MIN_PARAMS_PER_TOKEN
    assert (rstar_d, threshold) == fit_dropout(rstar)
    # Within one run's noise on every sweep: at 5 minutes on tiny Shakespeare dropout measured better, and the rule
    # keeps it at one of the two slowdowns its runs had (0.006 worse at the other).
    assert all(sweep.dropout_regret(rstar, rstar_d, threshold) < noise() for sweep in SWEEPS)
    assert total_dropout_regret(rstar, rstar, threshold) > spread  # no better discount with dropout: never kept
    assert total_dropout_regret(rstar, 8.0, threshold) > spread  # a smaller one drops it where it paid
    assert total_dropout_regret(rstar, rstar_d, 0.0) > 0  # no threshold: kept on a small model, measured worse

    # Dropout measured better at some of these runs and worse at others: the rule is not "always" nor "never". (Where
    # dropout was run at another shape than the law's, None: those runs do not judge the rule.)
    assert {s.dropout_measured_better(rstar) for s in SWEEPS if s.dropped} - {None} == {True, False}


def test_weight_decay_null_follows_the_epochs_planned_and_a_set_value_wins():
    """train.weight_decay null: the plan decides it from the epochs its steps cover (max_steps × tokens per step
    over the training tokens): sizing.WEIGHT_DECAY for a few passes, REPEATED_WEIGHT_DECAY from REPEATED_DECAY_EPOCHS;
    a number set is kept. The optimizer gets what the plan applied, and refuses a null that no plan resolved."""
    from ultrathink.train.optim import build_optimizers

    model_cfg = ModelConfig(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, seq_len=16)
    corpus = np.resize(np.arange(60), 6400).astype(np.uint16)  # 6,400 tokens; a step is 4 × 16 = 64 of them

    def planned(steps: int, weight_decay: float | None) -> Plan:
        train_cfg = TrainConfig(max_steps=steps, warmup_steps=2, batch_size=4, precision="fp32", attention="torch",
                                compile=False, weight_decay=weight_decay)
        return plan_run(model_cfg, train_cfg, 64, corpus, corpus[:640], "cpu").plan

    threshold_steps = math.ceil(round(sizing.REPEATED_DECAY_EPOCHS * 6400 / 64, 9))  # 4.9 * 100 is 490.00000000000006
    assert planned(threshold_steps - 1, None).weight_decay == sizing.WEIGHT_DECAY
    many = planned(threshold_steps, None)
    assert many.weight_decay == sizing.REPEATED_WEIGHT_DECAY
    assert "tokens), weight decay 1 (measured on" in Decided(many, True, {}, None, "").describe()
    assert planned(10 * threshold_steps, 0.3).weight_decay == planned(10, 0.3).weight_decay == 0.3
    assert [sizing.weight_decay_for(e) for e in (0.5, 4.8, 4.9, 50)] == [0.1, 0.1, 1.0, 1.0]

    _, applied = apply_plan(many, model_cfg, TrainConfig(weight_decay=None))
    assert applied.weight_decay == sizing.REPEATED_WEIGHT_DECAY
    assert many.mlflow_params()["plan.weight_decay"] == sizing.REPEATED_WEIGHT_DECAY
    from ultrathink.model import UltraThink
    (optimizer,) = build_optimizers(UltraThink(model_cfg, 64), applied)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [sizing.REPEATED_WEIGHT_DECAY, 0.0]
    with pytest.raises(ValueError, match="train.weight_decay is null: the run's plan decides it"):
        build_optimizers(UltraThink(model_cfg, 64), TrainConfig(weight_decay=None))
    # A plan recorded before weight decay was planned (its configuration set a number) leaves that number.
    old = Plan(None, 10, 1, 64, 1)
    assert apply_plan(old, model_cfg, TrainConfig(weight_decay=0.05))[1].weight_decay == 0.05


def test_the_repeated_texts_weight_decay_starts_where_the_measured_cells_fit():
    """REPEATED_DECAY_EPOCHS is fitted to runs of one configuration with each decay (sizing_evidence
    .WEIGHT_DECAY_CELLS): the stronger decay lost at 2.5–4.6 epochs, tied at 5.3, won from 6.8. Neither decay
    everywhere does as well: the cells are not "always" nor "never"."""
    from ultrathink.train.sizing_evidence import WEIGHT_DECAY_CELLS, fit_weight_decay_epochs, weight_decay_regret

    fitted = fit_weight_decay_epochs()
    assert sizing.REPEATED_DECAY_EPOCHS == fitted
    assert weight_decay_regret(0.0) > weight_decay_regret(fitted) + 0.01  # the strong decay everywhere
    assert weight_decay_regret(math.inf) > weight_decay_regret(fitted) + 0.05  # never
    assert {c.repeated < c.base for c in WEIGHT_DECAY_CELLS} == {True, False}


def test_a_model_at_the_bound_keeps_more_dropout_beside_the_repeated_texts_decay():
    """Beside the repeated-text decay a model of DROPOUT_AT_BOUND_PARAMS_PER_TOKEN or more (a budget large beside
    its corpus: the law's pick near its bound) keeps DROPOUT_AT_BOUND whatever its slowdown costs, and its tokens
    stop at dropout's later saturation; one just below keeps none; beside the base decay the law decides as
    before. The threshold is the one the runs fit: every pair at the bound measured better with dropout, and 0.2
    measured worse at every seed in runs of many epochs, at fewer per token."""
    from ultrathink.train.sizing_evidence import DROPOUT_AT_BOUND, dropout_at_bound_threshold

    threshold, unique = sizing.DROPOUT_AT_BOUND_PARAMS_PER_TOKEN, 300_000
    assert threshold == dropout_at_bound_threshold() == 30 and sizing.DROPOUT_AT_BOUND == 0.2
    assert all(pair.better_at_every_seed for pair in DROPOUT_AT_BOUND)
    assert min(pair.params_per_token for pair in DROPOUT_AT_BOUND) > threshold
    assert dropout_at_bound_threshold(erred_for_epochs=()) < threshold  # those losses bound it from below
    fewest = min(DROPOUT_AT_BOUND, key=lambda pair: pair.params_per_token)
    others = tuple(pair for pair in DROPOUT_AT_BOUND if pair is not fewest)
    rest = dropout_at_bound_threshold(others)
    assert rest > threshold  # the fewest per token that paid set it
    mixed = replace(fewest, dropped=(fewest.undropped[0] - 0.01, fewest.undropped[1] + 0.01))
    assert dropout_at_bound_threshold(others + (mixed,)) == rest  # better at one seed, worse at the other: left out
    lost = replace(fewest, dropped=tuple(u + 0.01 for u in fewest.undropped))  # worse at every seed
    assert dropout_at_bound_threshold(others + (lost,)) > fewest.params_per_token
    with pytest.raises(ValueError, match="no threshold separates them"):  # better only below where it was worse
        dropout_at_bound_threshold((replace(DROPOUT_AT_BOUND[1], params_per_token=20.0),))

    undropped = sizing.choose(ModelConfig(size="auto", dropout=0.0), 512, unique, flops=1e16)
    assert undropped.non_embedding_params > threshold * unique and undropped.dropout == 0.0
    repeated = sizing.REPEATED_WEIGHT_DECAY
    kept = sizing.with_dropout(undropped, unique, slowdown=1.5, weight_decay=repeated)
    assert kept.dropout == sizing.DROPOUT_AT_BOUND and kept.tokens == pytest.approx(undropped.tokens / 1.5)
    assert sizing.with_dropout(undropped, unique, slowdown=10.0, weight_decay=repeated).dropout == 0.2  # any cost
    assert sizing.with_dropout(undropped, unique, weight_decay=None).dropout == 0.2  # null: many epochs, 1.0
    below = replace(undropped, non_embedding_params=int(0.99 * threshold * unique), epochs=100.0)  # epochs: any
    assert sizing.with_dropout(below, unique, weight_decay=repeated).dropout == 0.0
    assert sizing.with_dropout(undropped, unique, weight_decay=sizing.WEIGHT_DECAY).dropout == sizing.DROPOUT

    chosen = sizing.choose(ModelConfig(size="auto"), 512, unique, flops=1e16)  # null dropout, null decay
    assert chosen.shape == undropped.shape and chosen.dropout == sizing.DROPOUT_AT_BOUND
    saturating = sizing.saturating_tokens(chosen.non_embedding_params, unique, sizing.DROPOUT_REPEAT_DECAY)
    assert chosen.tokens == pytest.approx(saturating) and chosen.tokens > 2.5 * undropped.tokens


def test_a_run_of_many_epochs_below_the_bound_keeps_no_dropout_beside_the_repeated_texts_decay():
    """Beside the repeated-text decay, reading the corpus many times does not keep dropout for a model below
    DROPOUT_AT_BOUND_PARAMS_PER_TOKEN, however many epochs or tokens it plans: every such run measured worse with
    DROPOUT_AT_BOUND at every seed, from 3.6 to 27 parameters per token, up to 5.1M parameters and 6.7M tokens,
    WikiText-2's at the shape and epochs where it had paid before the weight average and the output's temperature."""
    from ultrathink.train.sizing_evidence import DROPOUT_FOR_EPOCHS

    bound, unique = sizing.DROPOUT_AT_BOUND_PARAMS_PER_TOKEN, 600_000
    assert all(c.worse_at_every_seed for c in DROPOUT_FOR_EPOCHS)
    assert all(c.epochs > 9.5 and c.params_per_token < bound for c in DROPOUT_FOR_EPOCHS)
    per_token = [c.params_per_token for c in DROPOUT_FOR_EPOCHS]
    assert min(per_token) < 4 and max(per_token) > 25
    assert max(c.epochs * c.corpus_tokens for c in DROPOUT_FOR_EPOCHS) > 6e6
    assert all(len(c.undropped_runs) == len(c.dropped_runs) >= 1 for c in DROPOUT_FOR_EPOCHS)

    small = sizing.choose(ModelConfig(size="auto", dropout=0.0), 512, unique, flops=3e14)
    assert 5 * unique < small.non_embedding_params < bound * unique
    repeated = sizing.REPEATED_WEIGHT_DECAY
    for epochs in (10.0, 20.0, 100.0):
        many = replace(small, epochs=epochs, tokens=epochs * unique)
        assert sizing.with_dropout(many, unique, slowdown=1.3, weight_decay=repeated) == replace(many, dropout=0.0)
        assert sizing.with_dropout(many, unique, weight_decay=None) == replace(many, dropout=0.0)  # null: 1.0 too
    at_bound = replace(small, non_embedding_params=int(bound * unique), epochs=3.0, tokens=3.0 * unique)
    assert sizing.with_dropout(at_bound, unique, slowdown=1.3, weight_decay=repeated).dropout == sizing.DROPOUT_AT_BOUND


def test_dropout_is_not_weighed_beside_the_repeated_texts_decay_where_the_runs_say_so():
    """Where dropout paid beside the base decay (10 minutes on two corpora), the repeated-text decay alone
    measured better than with dropout added, and better than dropout beside the base decay: so the plan weighs
    dropout only beside a decay below REPEATED_WEIGHT_DECAY (sizing.with_dropout)."""
    from ultrathink.train.sizing_evidence import DROPOUT_OVER_DECAY

    assert len(DROPOUT_OVER_DECAY) >= 2
    assert all(c.undropped < min(c.dropped, c.base_dropped) for c in DROPOUT_OVER_DECAY)


def _undropped_then(probed: list[float], level: float) -> bool:
    """Whether a plan's probes ran without dropout, then (at least once) at `level` only."""
    first = probed.index(level) if level in probed else len(probed)
    return 0 < first < len(probed) and set(probed[:first]) == {0.0} and set(probed[first:]) == {level}


def test_a_time_plan_probes_dropout_where_it_could_pay_and_keeps_it_only_if_it_does():
    """The shape is sized at the step speed without dropout (what the loss law's runs had); where dropout could
    pay were it free, its step at that shape is probed and the law decides at the measured slowdown; the run's
    steps then come from the probe of what was chosen. A dropout set in params.yaml is probed from the first probe
    on, and a budget too short for dropout to pay probes none. All beside the base weight decay: where the plan
    picks the repeated-text decay (null, many epochs) dropout is weighed only for a model at the bound's end
    (DROPOUT_AT_BOUND_PARAMS_PER_TOKEN or more), and there kept, at DROPOUT_AT_BOUND; however many epochs a
    smaller one plans, it never probes dropout. Dropout kept, the shape is sized again with probes at dropout where
    it slows a step (the next test)."""
    def planned(model_cfg, budget="20s", cost=0.1, weight_decay=sizing.WEIGHT_DECAY, tokens=20_000):
        train_cfg = TrainConfig(budget=budget, batch_size=None, precision="fp32", attention="torch", eval_batches=2,
                                weight_decay=weight_decay)
        probed = []

        def probe(model, train, kernel):
            probed.append(model.dropout)
            return Probe(step_seconds=0.01 * (1 + cost * model.dropout / sizing.DROPOUT), first_steps_extra=0.1,
                         eval_seconds=0.05, save_seconds=0.05, seconds=0.5)
        return _time_plan(model_cfg, train_cfg, _stream(tokens), probe), probed

    plan, probed = planned(ModelConfig(size="auto"))  # 20 s on 20,000 tokens: many epochs; dropout 10% dearer
    assert plan.sizing["dropout"] == sizing.DROPOUT and plan.sizing["epochs"] > 10
    assert _undropped_then(probed, sizing.DROPOUT)  # kept, so the shape was sized again at dropout's speed
    assert plan.probe.step_seconds == pytest.approx(0.011)
    assert plan.probe.seconds == pytest.approx(0.5 * len(probed))  # the budget pays every probe
    assert plan.decisions()["dropout"] == sizing.DROPOUT and plan.mlflow_params()["plan.model.dropout"] == 0.1
    model, train = apply_plan(plan, ModelConfig(size="auto"), TrainConfig(budget="20s", batch_size=None))
    assert model.dropout == sizing.DROPOUT
    dear, probed = planned(ModelConfig(size="auto"), cost=20.0)  # a step with dropout 21× as long: it cannot pay
    assert dear.sizing["dropout"] == 0.0 and probed[-1] == sizing.DROPOUT
    assert dear.probe.step_seconds == pytest.approx(0.01)  # the steps are the undropped probe's
    assert apply_plan(dear, ModelConfig(size="auto"), TrainConfig(budget="20s", batch_size=None))[0].dropout == 0.0
    noisy, _ = planned(ModelConfig(size="auto"), cost=-0.5)  # measured faster with dropout: noise, taken as 1×
    assert noisy.sizing["dropout"] == sizing.DROPOUT
    assert noisy.sizing["tokens"] == pytest.approx(plan.sizing["tokens"] * 1.1)  # not more than without dropout
    short, probed = planned(ModelConfig(size="auto"), budget="0.1s")
    assert short.sizing["dropout"] == 0.0 and set(probed) == {0.0}
    kept, probed = planned(ModelConfig(size="auto", dropout=0.0))
    assert kept.sizing["dropout"] == 0.0 and set(probed) == {0.0}
    set_high, probed = planned(ModelConfig(size="auto", dropout=0.2))
    assert set_high.sizing["dropout"] == 0.2 and set(probed) == {0.2}
    decayed, probed = planned(ModelConfig(size="auto"), weight_decay=None)  # 70 parameters per token
    assert decayed.weight_decay == sizing.REPEATED_WEIGHT_DECAY
    assert decayed.sizing["dropout"] == sizing.DROPOUT_AT_BOUND and _undropped_then(probed, sizing.DROPOUT_AT_BOUND)
    assert decayed.sizing["shape"] == plan.sizing["shape"]
    assert decayed.sizing["non_embedding_params"] > sizing.DROPOUT_AT_BOUND_PARAMS_PER_TOKEN * 20_000
    wider = ModelConfig(size="auto", d_model=384, n_layers=3)  # fewer parameters per token, many epochs and tokens
    many_epochs, probed = planned(wider, budget="90s", weight_decay=None, tokens=300_000)
    assert many_epochs.weight_decay == sizing.REPEATED_WEIGHT_DECAY
    params = many_epochs.sizing["non_embedding_params"]
    assert 5 < params / 300_000 < sizing.DROPOUT_AT_BOUND_PARAMS_PER_TOKEN
    assert many_epochs.sizing["epochs"] > 10 and many_epochs.sizing["tokens"] > 5e6
    assert many_epochs.sizing["dropout"] == 0.0 and set(probed) == {0.0}  # never worth a probe
    smallest, probed = planned(ModelConfig(size="auto", d_model=64, n_layers=1), weight_decay=None)
    assert smallest.sizing["epochs"] > 10 and smallest.weight_decay == 1.0
    assert smallest.sizing["dropout"] == 0.0 and set(probed) == {0.0}


def test_a_time_plan_that_keeps_dropout_sizes_its_shape_again_at_dropouts_speed():
    """Dropout is weighed at the shape sized for the step without it. On a CPU a step with it took 1.8× as long
    (attention leaves the flash kernel), so that shape read tiny Shakespeare 6 times in 10 minutes where 11 were
    planned, and scored worse than 2 minutes (benchmarks/README.md). Where the plan keeps dropout it sizes the shape
    again at the speed its probes measure with dropout, as it sizes one for a dropout set in params.yaml; not where
    dropout costs a step little (a GPU's), which would only spend the budget on probes. (Three hours on 300,000
    tokens: the undropped choice, d384 x 7, has 41 non-embedding parameters per token, enough to keep dropout.)"""
    corpus, vocab = 300_000, 64

    def planned(model_cfg, slowdown=1.8, side_by_side=False):
        train_cfg = TrainConfig(budget="10800s", batch_size=None, precision="fp32", attention="torch", eval_batches=2)
        probed = []

        def step(model, train) -> float:  # a step's time follows its FLOPs; dropout slows it `slowdown`×
            flops = sizing.counts(sizing.Shape.of(model), model, vocab)[2] * train.batch_size * model.seq_len
            return (flops / 3e10 + 0.002) * (slowdown if model.dropout else 1.0)

        def probe(model, train, kernel):
            probed.append(model.dropout)
            return Probe(step_seconds=step(model, train), first_steps_extra=0.1, eval_seconds=0.05,
                         save_seconds=0.05, seconds=0.5)

        def agreeing(configs):  # measured side by side as the probes measured them
            return [step(model, train) for model, train, _ in configs], 0.5
        gflops = {"fp32": 100.0, "bf16": 200.0}  # a fixed peak: the first guess does not follow this machine's
        return decide(model_cfg, train_cfg, vocab, _stream(corpus), "cpu", 1, gflops, probe,
                      agreeing if side_by_side else None), probed

    null, probed = planned(ModelConfig(size="auto"))
    assert null.weight_decay == sizing.REPEATED_WEIGHT_DECAY and null.sizing["dropout"] == sizing.DROPOUT_AT_BOUND
    assert _undropped_then(probed, sizing.DROPOUT_AT_BOUND)
    [undropped] = [m for m in null.sizing["measured"] if m["why"] == "the choice without dropout, dropout 0.2"]
    assert (undropped["shape"], undropped["batch_size"]) != (null.sizing["shape"], null.sizing["batch_size"])
    assert null.sizing["epochs"] > 1.2 * undropped["tokens"] / corpus  # 10.9 epochs; that shape at its speed: 7.8
    # Measured again side by side where shapes are near, at each round's dropout, the same speeds choose the same.
    again = planned(ModelConfig(size="auto"), side_by_side=True)[0].sizing
    assert (again["shape"], again["batch_size"], again["dropout"]) == \
        (null.sizing["shape"], null.sizing["batch_size"], null.sizing["dropout"])
    assert any(m["why"].endswith(", again side by side, dropout 0.2") for m in again["measured"])
    never = planned(ModelConfig(size="auto", dropout=0.0))[0].sizing  # the first round: the speed without dropout
    assert (never["shape"], never["batch_size"]) == (undropped["shape"], undropped["batch_size"])
    set_high = planned(ModelConfig(size="auto", dropout=0.2))[0].sizing
    assert (set_high["shape"], set_high["batch_size"]) == (null.sizing["shape"], null.sizing["batch_size"])
    # A step with dropout within RESIZE_SLOWDOWN of the one without (a GPU's): the shape is kept, one probe with it.
    cheap, probed = planned(ModelConfig(size="auto"), slowdown=0.99 * plan_module.RESIZE_SLOWDOWN)
    assert (cheap.sizing["shape"], cheap.sizing["dropout"]) == (never["shape"], sizing.DROPOUT_AT_BOUND)
    assert probed.count(sizing.DROPOUT_AT_BOUND) == 1 and _undropped_then(probed, sizing.DROPOUT_AT_BOUND)


def test_auto_vocabulary_follows_the_corpus_size_and_the_budget(tmp_path):
    assert [auto_vocab_size(n) for n in (10_000, 1_000_000, 10**9, 10**12)] == [320, 512, 15808, 32768]
    # A long run (a minute or more, 1.5M tokens or more) takes √bytes, twice the short run's share, within the bounds.
    long_runs = ["1min", "2min", "1.5h", "1.5e6tokens"]
    assert [auto_vocab_size(1_000_000, b) for b in long_runs] == [1024] * 4
    assert [auto_vocab_size(n, "2min") for n in (10_000, 10**9, 10**12)] == [320, 31616, 32768]
    short_runs = [None, "12s", "59s", "1e6tokens", "1e18flops"]  # FLOPs: the tokens follow the shape the plan picks
    assert [auto_vocab_size(1_000_000, b) for b in short_runs] == [512] * 5
    # A long time budget trained in fp32 takes 1.5·√bytes; a short one, or a budget of tokens, the same as in bf16.
    assert [auto_vocab_size(1_000_000, b, "fp32") for b in ("1min", "2min", "1.5h")] == [1472] * 3
    assert [auto_vocab_size(1_000_000, b, "bf16") for b in ("1min", "2min", "1.5h")] == [1024] * 3
    assert [auto_vocab_size(1_000_000, b, "fp32") for b in ("59s", "1.5e6tokens", "1e18flops")] == [512, 1024, 512]
    assert [precision_matters(b) for b in (None, "59s", "1min", "1.5e6tokens", "1e18flops")] == \
        [False, False, True, False, False]
    texts = [f"line {i} of a small corpus about cats, dogs and number {i * 7}" for i in range(3000)]
    n_bytes = sum(len(t) for t in texts)
    size = train_tokenizer(texts, TokenizerConfig(vocab_size="auto"), tmp_path / "tok")
    assert size == auto_vocab_size(n_bytes) == 320
    assert len(load_tokenizer(tmp_path / "tok")) <= size
    longer = train_tokenizer(texts, TokenizerConfig(vocab_size="auto"), tmp_path / "long", budget="2min")
    assert longer == auto_vocab_size(n_bytes, "2min") == 448
    assert size < len(load_tokenizer(tmp_path / "long")) <= longer
    in_fp32 = train_tokenizer(texts, TokenizerConfig(vocab_size="auto"), tmp_path / "fp32", "2min", "fp32")
    assert in_fp32 == auto_vocab_size(n_bytes, "2min", "fp32") == 640
    assert longer < len(load_tokenizer(tmp_path / "fp32")) <= in_fp32
    assert train_tokenizer(texts, TokenizerConfig(vocab_size=320), tmp_path / "set", budget="2min") == 320
    with pytest.raises(ValueError, match="vocab_size"):
        TokenizerConfig(vocab_size=100)


def test_the_tokenizer_stage_sizes_an_auto_vocabulary_for_the_precision_train_precision_auto_measures(
        tmp_path, monkeypatch, capsys):
    """The stage under train.precision auto: the vocabulary follows the precision the measurement picks (fp32
    where bf16 measures no faster, as on an AVX2-only CPU), and only an auto vocabulary under a long time budget
    measures at all."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"line {i} of a small corpus about cats, dogs and number {i * 7}"})
                              + "\n" for i in range(3000)))
    n_bytes = sum(len(t.encode("utf-8")) for t in training_texts(corpus, Params().prepare))
    measured, speeds = [], {}
    monkeypatch.setattr(precision_module, "matmul_gflops", lambda dtype: measured.append(dtype) or speeds[dtype])

    def vocabulary(vocab_size, budget: str, fp32: float, bf16: float) -> str:
        """What the stage printed, having trained under these measured matmul speeds (GFLOP/s)."""
        speeds.update({torch.float32: fp32, torch.bfloat16: bf16})
        measured.clear()
        precision_module.resolve_precision.cache_clear()  # a measurement is kept per process: this one stands for another machine
        tokenizer_stage.run(Params(tokenizer={"vocab_size": vocab_size},
                                   train={"budget": budget, "precision": "auto"},
                                   paths={"validated_corpus": str(corpus), "tokenizer_dir": str(tmp_path / "tok")}))
        return capsys.readouterr().out

    try:
        in_fp32, in_bf16 = auto_vocab_size(n_bytes, "2min", "fp32"), auto_vocab_size(n_bytes, "2min")
        assert in_fp32 > in_bf16 == auto_vocab_size(n_bytes, "2min", "bf16")
        assert (f"vocab {in_fp32} (tokenizer.vocab_size auto: from the corpus size, for a long run in fp32: "
                f"train.budget 2min, training in fp32)") in vocabulary("auto", "2min", fp32=100, bf16=100)
        assert measured == [torch.float32, torch.bfloat16]
        assert len(load_tokenizer(tmp_path / "tok")) <= in_fp32
        assert (f"vocab {in_bf16} (tokenizer.vocab_size auto: from the corpus size, for a long run: "
                f"train.budget 2min, training in bf16)") in vocabulary("auto", "2min", fp32=100, bf16=300)
        # A set vocabulary, or a budget too short for the precision to matter, never measures.
        assert "vocab 320 saved" in vocabulary(320, "2min", fp32=100, bf16=100) and measured == []
        assert (f"vocab {auto_vocab_size(n_bytes, '30s')} (tokenizer.vocab_size auto: from the corpus size, for a "
                f"short run: train.budget 30s)") in vocabulary("auto", "30s", fp32=100, bf16=100)
        assert measured == []
    finally:
        precision_module.resolve_precision.cache_clear()  # the next caller in this process measures this machine, not these figures


# The matmul peak a plan with made-up probes is decided at. Measured, it moves with the machine and its load, and the
# first guess with it: pinned at 30-80 or 1500 GFLOP/s in fp32, a test's first probe went to another shape, where its
# premise no longer held (a full run with two xdist workers on 2 cores of a Zen 4 failed so).
FIXED_PEAK = {"fp32": 300.0}


def _time_plan(model_cfg, train_cfg, train_tokens, probe) -> Plan:
    """A CPU plan decided at FIXED_PEAK with `probe` for its probes (plan_run's decision without its measurement)."""
    return decide(model_cfg, train_cfg, 64, train_tokens, "cpu", 1, FIXED_PEAK, probe)


def _probe_at_a_flop_rate(probed: list, slowdown=lambda shape: 1.0, save_seconds=lambda shape: 0.05):
    """A time plan's probe that steps at 2e10 FLOP/s times `slowdown` of the (width, depth) probed, and appends
    that shape to `probed`."""
    def probe(model, train, kernel):
        flops = sizing.counts(sizing.Shape.of(model), model, 64)[2] * train.batch_size * model.seq_len
        probed.append((model.d_model, model.n_layers))
        return Probe(step_seconds=flops / 2e10 * slowdown(probed[-1]), first_steps_extra=0.1, eval_seconds=0.05,
                     save_seconds=save_seconds(probed[-1]), seconds=0.5)
    return probe


def test_a_time_plan_decides_between_the_shapes_it_probed_by_their_measured_speed():
    """The step-cost model picks which shapes a time budget probes; between two probed shapes the law decides at
    the tokens each one's measured speed buys in the seconds the budget leaves for training at that shape (less
    the probes, the first steps' extra, and its own validation passes and checkpoints). Probes at one FLOP rate for
    every shape agree with the model, and its second pick is kept; a second shape measured 3× slower than that (a
    small batch's fixed work per step, which the model has no term for), or one whose checkpoint costs a third of
    the budget (a large model's save on a GPU), loses to the first, whose probe then sets the steps. Nothing is
    probed again for it, and the tokens the plan was sized for are those its steps train. (A third probe, of the
    law's near runner-up, may follow: the next test.)"""
    def planned(slow: tuple[int, int] | None = None, dear_save: tuple[int, int] | None = None):
        train_cfg = TrainConfig(budget="60s", batch_size=None, precision="fp32", attention="torch", eval_batches=2)
        probed = []
        probe = _probe_at_a_flop_rate(probed, lambda shape: 3.0 if shape == slow else 1.0,
                                      lambda shape: 20.0 if shape == dear_save else 0.05)
        return _time_plan(ModelConfig(size="auto", dropout=0.0), train_cfg, _stream(200_000), probe), probed

    fair, probed = planned()
    first, second = probed[:2]
    assert first != second and (fair.sizing["shape"]["d_model"], fair.sizing["shape"]["n_layers"]) == second
    assert fair.sizing["tokens"] == fair.max_steps * fair.tokens_per_step
    for slowed, probed_again in (planned(slow=second), planned(dear_save=second)):
        assert probed_again[:2] == probed[:2] and len(probed_again) <= 3  # nothing probed again for the choice
        shape = slowed.sizing["shape"]
        assert (shape["d_model"], shape["n_layers"]) in set(probed_again) - {second}
        first_step = sizing.counts(sizing.Shape(**shape), ModelConfig(**{**shape, "dropout": 0.0}), 64)[2] \
            * slowed.sizing["batch_size"] * shape["seq_len"] / 2e10
        assert slowed.probe.step_seconds == pytest.approx(first_step)  # the steps are the chosen shape's probe's
        assert slowed.sizing["tokens"] == slowed.max_steps * slowed.tokens_per_step
        assert slowed.sizing["tokens"] < 60 * 2e10 / slowed.flops_per_token  # not the whole budget's
        assert slowed.probe.seconds == pytest.approx(0.5 * len(probed_again))  # every probe paid from the budget


def test_a_time_plan_measures_a_near_runner_up_whose_speed_the_step_cost_model_may_have_misjudged(monkeypatch):
    """The step-cost model is fitted to one probed shape; another's speed it has mispredicted by up to a fifth of
    its tokens (on a Zen 5 it chose d320 × 4 over an unprobed d256 × 4 that measured 0.047 bits/byte better on
    Pride). So the law's runner-up, where predicted within sizing.MEASURE_MARGIN of the choice, is probed too, and
    the measured speeds decide: measured twice as fast as the model says, it wins; predicted exactly, it does not;
    with no margin it is never measured and cannot win. The plan keeps what it compared: every probed shape with
    the tokens its measured speed buys and the loss the law predicts for them."""
    def planned(fast: tuple[int, int] | None = None):
        train_cfg = TrainConfig(budget="60s", batch_size=None, precision="fp32", attention="torch", eval_batches=2)
        probed = []
        probe = _probe_at_a_flop_rate(probed, lambda shape: 0.5 if shape == fast else 1.0)
        plan = _time_plan(ModelConfig(size="auto", dropout=0.0), train_cfg, _stream(200_000), probe)
        measured = {(m["shape"]["d_model"], m["shape"]["n_layers"]): m for m in plan.sizing["measured"]}
        assert list(measured) == probed and measured[probed[-1]]["tokens"] > 0
        assert [m["why"] for m in measured.values()][:2] == ["first guess", "refitted choice"]
        assert len(probed) < 3 or measured[probed[2]]["why"] in ("last choice", "near runner-up")
        assert min(measured.values(), key=lambda m: m["predicted_loss"])["shape"] == plan.sizing["shape"]
        line = sizing.Sizing.from_dict(plan.sizing).explain()  # what the run logs
        assert all(f"{w}x{depth} batch " in line.split("measured: ")[1] for w, depth in probed)
        return (plan.sizing["shape"]["d_model"], plan.sizing["shape"]["n_layers"]), probed, measured

    chosen, probed, measured = planned()
    assert len(probed) == 3 and chosen == probed[1]
    runner_up = probed[2]
    assert measured[runner_up]["why"] == "near runner-up"
    won, probed_fast, measured_fast = planned(fast=runner_up)
    assert (won, probed_fast) == (runner_up, probed)
    # Twice the speed, about twice the tokens (its more steps also validate and save more often).
    assert measured_fast[runner_up]["tokens"] == pytest.approx(2 * measured[runner_up]["tokens"], rel=0.05)
    assert measured_fast[runner_up]["predicted_loss"] < measured[runner_up]["predicted_loss"]
    assert measured_fast[chosen] == measured[chosen]
    monkeypatch.setattr(sizing, "MEASURE_MARGIN", 0.0)
    assert planned(fast=runner_up)[:2] == (chosen, probed[:2])


def test_shapes_a_wandering_machine_could_have_misordered_are_measured_again_side_by_side(monkeypatch):
    """A probe times one moment of the machine, and a shared CPU's speed wanders by a fifth within seconds
    (sizing.PROBE_SPREAD): two shapes probed one after the other were measured as fast as each other where one
    steps 1.46× as long as the other, and the plan then chose the larger, 0.05 bits/byte worse (benchmarks/
    README.md). So the choice and every probed shape the law could put ahead of it within that spread are stepped
    again in turn (budget.step_seconds_side_by_side), and those step times decide. A runner-up whose probe read
    its step a quarter short is then not chosen; one twice as fast side by side is. The budget pays
    for the measurement, the plan keeps what was measured again, and nothing is measured again where no probed
    shape is that near, or on a GPU, or without a side-by-side measurement to call."""
    train_cfg = TrainConfig(budget="60s", batch_size=None, precision="fp32", attention="torch", eval_batches=2)

    def planned(fast_probe=None, fast_side_by_side=None, device="cpu", through_plan_run=False):
        probed, compared = [], []
        probe = _probe_at_a_flop_rate(probed, lambda shape: 0.75 if shape == fast_probe else 1.0)

        def side_by_side(configs):
            shapes = [(model.d_model, model.n_layers) for model, _, _ in configs]
            compared.append(shapes)
            steps = [sizing.counts(sizing.Shape.of(model), model, 64)[2] * train.batch_size * model.seq_len / 2e10
                     for model, train, _ in configs]
            return [s * (0.5 if shape == fast_side_by_side else 1.0) for s, shape in zip(steps, shapes)], 0.8

        if through_plan_run:  # its own probe (patched: no real steps) and the side-by-side measurement given
            monkeypatch.setattr(plan_module, "_probe_here", lambda *args: probe(*args[-3:]))
            monkeypatch.setattr(plan_module, "cpu_matmul_gflops", lambda *args: FIXED_PEAK)
            plan = plan_run(ModelConfig(size="auto", dropout=0.0), train_cfg, 64, _stream(200_000), _stream(2000),
                            device, side_by_side=side_by_side).plan
        else:
            plan = decide(ModelConfig(size="auto", dropout=0.0), train_cfg, 64, _stream(200_000), device, 1,
                          FIXED_PEAK, probe, side_by_side)
        return (plan.sizing["shape"]["d_model"], plan.sizing["shape"]["n_layers"]), probed, compared, plan

    chosen, probed, compared, fair = planned()
    assert len(probed) == 3 and chosen == probed[1]
    runner_up = probed[2]  # the law's near runner-up: within the spread of the choice (and so is the first guess)
    [first] = compared
    assert first[0] == chosen and runner_up in first and set(first) <= set(probed)
    assert fair.probe.seconds == pytest.approx(0.5 * 3 + 0.8)  # the budget pays for it
    again = [m for m in fair.sizing["measured"] if m["why"].endswith(", again side by side")]
    assert {(m["shape"]["d_model"], m["shape"]["n_layers"]) for m in again} == set(first)
    # The runner-up's probe read its step a quarter short: side by side it is not, and the choice stands. Without
    # the side-by-side measurement the misread probe would have won.
    misread, probed_fast, compared_fast, plan = planned(fast_probe=runner_up)
    assert (misread, probed_fast) == (chosen, probed) and compared_fast[0][0] == runner_up
    assert chosen in compared_fast[0]
    assert plan.probe.step_seconds == pytest.approx(fair.probe.step_seconds)  # the steps: its side-by-side time
    alone = decide(ModelConfig(size="auto", dropout=0.0), train_cfg, 64, _stream(200_000), "cpu", 1, FIXED_PEAK,
                   _probe_at_a_flop_rate([], lambda shape: 0.75 if shape == runner_up else 1.0))
    assert (alone.sizing["shape"]["d_model"], alone.sizing["shape"]["n_layers"]) == runner_up
    # Twice as fast side by side: it wins.
    assert planned(fast_probe=runner_up, fast_side_by_side=runner_up)[0] == runner_up
    # plan_run probes in this process unless given a probe; a side-by-side measurement given alone is the one used.
    assert planned(through_plan_run=True)[:3] == (chosen, probed, [first])
    assert planned(fast_probe=runner_up, fast_side_by_side=runner_up, through_plan_run=True)[0] == runner_up
    # No probed shape within the spread, or a GPU: nothing is measured again.
    assert planned(device="cuda")[2] == []
    monkeypatch.setattr(plan_module.sizing, "PROBE_SPREAD", 0.0)
    assert planned()[:3] == (chosen, probed, [])


def test_a_time_plan_leaves_out_shapes_that_ran_out_of_memory_in_their_probe(caplog):
    """A time budget's first guess comes from the device's peak, so a short budget on a small GPU can guess a model
    that does not fit (a 2-minute guess on an H200 was 434M parameters). The sizing chose it, not the user: the
    plan leaves it and every larger shape out and chooses again. When no shape is left, the error says why."""
    def planned(fits_below: int):
        train_cfg = TrainConfig(budget="60s", batch_size=None, precision="fp32", attention="torch", eval_batches=2)
        probed = []

        def probe(model, train, kernel):
            params = sizing.counts(sizing.Shape.of(model), model, 64)[0]
            probed.append(params)
            if params >= fits_below:
                raise torch.OutOfMemoryError("CUDA out of memory (as the device would say it)")
            flops = sizing.counts(sizing.Shape.of(model), model, 64)[2] * train.batch_size * model.seq_len
            return Probe(step_seconds=flops / 2e10, first_steps_extra=0.1, eval_seconds=0.05, save_seconds=0.05,
                         seconds=0.5)
        return _time_plan(ModelConfig(size="auto", dropout=0.0), train_cfg, _stream(200_000), probe), probed

    _, probed = planned(fits_below=10**12)  # at one peak, so both plans make the same first guess
    first_guess = probed[0]
    with caplog.at_level("WARNING", logger="ultrathink.train.plan"):
        cramped, tried = planned(fits_below=first_guess)
    assert tried[0] == first_guess and all(params < first_guess for params in tried[1:]) and len(tried) >= 2
    assert cramped.sizing["params"] < first_guess
    assert "ran out of cpu memory in its probe; choosing among smaller shapes" in caplog.text
    assert cramped.sizing["tokens"] == cramped.max_steps * cramped.tokens_per_step
    with pytest.raises(ValueError, match="no valid shape below 1 parameters"):
        sizing.choose(ModelConfig(size="auto"), 64, 200_000, seconds=60.0, cost=sizing.StepCost(2e10), below_params=1)


def _stream(n=20_000) -> np.ndarray:
    return np.resize(np.random.default_rng(0).integers(0, 60, 41), n).astype(np.uint16)


def test_shapes_measured_side_by_side_step_in_turn_on_throwaway_copies():
    """budget.step_seconds_side_by_side times real throwaway models: the deeper and wider shape's step is the
    longer, the seconds it took are returned for the budget, and the run's generators are as they were."""
    def config(width: int, depth: int, seq_len: int, batch: int):
        model = ModelConfig(d_model=width, n_layers=depth, n_heads=2, n_kv_heads=2, seq_len=seq_len, dropout=0.0)
        train = TrainConfig(batch_size=batch, precision="fp32", attention="torch", weight_decay=0.1, compile=False)
        return model, train, None

    torch.manual_seed(5)
    before = torch.get_rng_state()
    started = time.perf_counter()
    # ~30 times the small shape's work (2.8 vs 80 ms a step on a Zen 4), not ~4.5 times: on CI's loaded 2 cores
    # the small one's median once read 100 ms against d128 x 4 b4 seq 32's 60 ms.
    (small, large), seconds = step_seconds_side_by_side([config(32, 1, 32, 4), config(256, 4, 64, 8)], 64, _stream(),
                                                        _stream(2000), "cpu")
    assert torch.equal(torch.get_rng_state(), before)
    assert 0 < small < large and 0 < seconds <= time.perf_counter() - started
    assert PROBE_STEPS == 5 and seconds > 3 * (small + large)  # each one's median: 3 of its 5 steps took as long


RANKS_SIDE_BY_SIDE = """
import json, sys
from pathlib import Path
import numpy as np
from ultrathink.config import ModelConfig, TrainConfig
from ultrathink.train.distributed import setup
from ultrathink.train.plan import RankProbes

dist = setup("ddp")
tokens = np.resize(np.random.default_rng(0).integers(0, 60, 41), 20_000).astype(np.uint16)
probes = RankProbes(dist, 64, tokens, tokens[:2000])
train = TrainConfig(batch_size=4, precision="fp32", attention="torch", weight_decay=0.1, compile=False, threads=1)
# ~30 times the small shape's work, so that a loaded machine's noise cannot reorder their medians.
configs = [(ModelConfig(d_model=w, n_layers=l, n_heads=2, n_kv_heads=2, seq_len=seq, dropout=0.0),
            train.model_copy(update={"batch_size": batch}), None)
           for w, l, seq, batch in ((32, 1, 32, 4), (256, 4, 64, 8))]
if dist.is_main:
    steps, seconds = probes.side_by_side(configs)
    probe = probes.probe(*configs[0])
    dist.share({"plan": {"steps": steps}})
    out = {"steps": steps, "seconds": seconds, "probe": probe.step_seconds}
else:
    out = probes.follow()
Path(sys.argv[1], f"rank{dist.rank}.json").write_text(json.dumps(out))
dist.close()
"""


@pytest.mark.spawns
def test_the_ranks_of_a_run_measure_side_by_side_together(tmp_path):
    """A time budget's probes run on every rank of the run (RankProbes): the main rank announces each, the others
    follow; the side-by-side measurement is announced and followed the same way, between probes, until the plan."""
    (tmp_path / "ranks.py").write_text(RANKS_SIDE_BY_SIDE)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(tmp_path / "ranks.py"), str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    main, other = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    small, large = main["steps"]
    assert 0 < small < large and main["seconds"] > 0 and main["probe"] > 0
    assert other == {"plan": {"steps": main["steps"]}}


def test_a_time_plan_probes_a_copy_and_leaves_the_generators_alone():
    model_cfg = ModelConfig(size="auto", dropout=0.1)
    # 60 s, not less: on a loaded 2-core machine (CI, -n 2) the probe of a 20 s budget once took most of its seconds.
    train_cfg = TrainConfig(budget="60s", batch_size=None, precision="fp32", eval_batches=2, warmup_fraction=0.1)
    torch.manual_seed(5)
    before = torch.get_rng_state()
    plan = plan_run(model_cfg, train_cfg, 64, _stream(), _stream(2000), "cpu").plan
    model, train = apply_plan(plan, model_cfg, train_cfg)
    assert torch.equal(torch.get_rng_state(), before)
    assert model.resolved and model.size == "manual" and train.batch_size == plan.sizing["batch_size"]
    assert plan.probe.step_seconds > 0 and plan.probe.seconds < 60
    # A tenth of the steps, at least one (a loaded machine's budget can buy few steps: CI's 20 s once bought 5).
    assert plan.max_steps == train.max_steps and plan.warmup_steps == max(1, round(0.1 * plan.max_steps))
    # The steps the plan buys fit the budget at the measured speed.
    spent = plan.probe.seconds + plan.probe.first_steps_extra + plan.max_steps * plan.probe.step_seconds
    assert spent <= 60 and plan.tokens_per_step == train.batch_size * model.seq_len
    again_model, again_train = apply_plan(Plan.from_dict(json.loads(json.dumps(plan.to_dict()))), model_cfg,
                                          train_cfg)
    assert again_model == model and again_train == train


def recorded_plans(project: Path, budget: str) -> list[dict]:
    """The plans of `budget` in the project's book (it also holds the shipped configuration's reference plan)."""
    book = json.loads((project / "plans/train.json").read_text())
    return [plan for entry in book.values() for plan in entry["plans"].values() if plan["budget"] == budget]


def _prepared(tmp_path, changes: dict) -> Path:
    project = make_project(tmp_path)
    set_params(project, changes)
    for stage in ("validate", "tokenizer", "prepare"):
        sh([sys.executable, "-m", f"tasks.{stage}"], project)
    return project


@pytest.mark.spawns
@pytest.mark.slow
def test_train_stage_spends_a_budget_records_the_plan_and_reuses_it(tmp_path, monkeypatch):
    project = _prepared(tmp_path, {"tokenizer": {"vocab_size": "auto"},
                                   "model": {"size": "auto", **AUTO_SHAPE},
                                   "train": {"budget": "6s", "batch_size": None, "warmup_fraction": 0.1,
                                             "eval_every": 50, "checkpoint_every": 50, "log_every": 25}})
    done = sh([sys.executable, "-m", "tasks.train"], project)
    assert "plan:" in done.stderr and "model.size auto: d_model" in done.stderr
    summary = json.loads((project / "artifacts/model/train_summary.json").read_text())
    plan = summary["plan"]
    assert summary["steps"] == plan["max_steps"] > 0 and "probe" not in plan
    (plan,) = recorded_plans(project, "6s")
    assert plan["probe"]["step_seconds"] > 0 and plan["max_steps"] == summary["steps"]
    config = json.loads((project / "artifacts/model/config.json").read_text())["model"]
    assert {k: config[k] for k in sizing.SHAPE_KEYS} == plan["sizing"]["shape"]
    assert config["dropout"] == plan["sizing"]["dropout"] in (0.0, sizing.DROPOUT, sizing.DROPOUT_AT_BOUND)
    run = client_for(project).search_runs([client_for(project).get_experiment_by_name("ultrathink").experiment_id])[0]
    assert run.data.params["plan.max_steps"] == str(plan["max_steps"])
    assert run.data.params["train.budget"] == "6s" and run.data.params["model.size"] == "auto"
    assert int(run.data.params["plan.model.d_model"]) == plan["sizing"]["shape"]["d_model"]
    assert float(run.data.params["plan.model.dropout"]) == config["dropout"]
    assert float(run.data.params["plan.weight_decay"]) == plan["weight_decay"] in (sizing.WEIGHT_DECAY,
                                                                                  sizing.REPEATED_WEIGHT_DECAY)
    # The loss curve has every step's point (sent in batches of log_every).
    assert len(client_for(project).get_metric_history(run.info.run_id, "train_loss")) == plan["max_steps"]

    # Run again: the configuration's recorded plan is read back, nothing is measured, the run resumes at its end.
    from ultrathink.stages import pretrain
    from ultrathink.train import plan as plan_module
    from ultrathink.train.distributed import Distributed

    monkeypatch.chdir(project)
    monkeypatch.setattr(plan_module, "decide", lambda *a, **k: pytest.fail("a recorded plan was re-measured"))
    params = load_params(project / "params.yaml")
    trainer, _, again, resumed = pretrain.build_trainer(params, Distributed())
    assert not again.measured and again.plan.to_dict() == plan and trainer.cfg.max_steps == plan["max_steps"]
    assert trainer.engine.optimizers[0].param_groups[0]["weight_decay"] == plan["weight_decay"]
    assert run.data.params["plan.seq_len_warmup_steps"] == str(plan["seq_len_warmup_steps"])
    assert trainer.context == (ContextWarmup(plan["seq_len_warmup_steps"], config["seq_len"])
                               if plan["seq_len_warmup_steps"] else None)
    assert resumed == plan["max_steps"]

    # A sweep of the learning rate and the seed (`dvc exp run -S train.lr=... -S train.seed=...`) reads the same
    # plan: the same shape, batch and steps, nothing measured; its weights are its own (another configuration).
    sweep = {"lr": params.train.lr / 3, "seed": params.train.seed + 1}
    params = params.model_copy(update={"train": params.train.model_copy(update=sweep)})
    swept, _, read, swept_resumed = pretrain.build_trainer(params, Distributed())
    assert not read.measured and read.key == again.key and read.plan.to_dict() == plan
    assert swept.model.cfg == trainer.model.cfg and swept.cfg.batch_size == trainer.cfg.batch_size
    assert swept.cfg.max_steps == plan["max_steps"] and swept.cfg.lr == sweep["lr"]
    assert swept.checkpoints.fingerprint != trainer.checkpoints.fingerprint and swept_resumed is None


@pytest.mark.spawns
@pytest.mark.slow
def test_a_tokens_budget_trains_exactly_its_steps(tmp_path):
    project = _prepared(tmp_path, {"train": {"budget": "3000tokens", "warmup_fraction": 0.25, "seq_len_warmup": 0.3}})
    sh([sys.executable, "-m", "tasks.train"], project)
    summary = json.loads((project / "artifacts/model/train_summary.json").read_text())
    # TINY trains 4 windows of 32 tokens a step, 128 tokens: 23 steps (2,944 tokens) fall short of 3,000 and 24
    # (3,072) cover it, so the budget buys 24 steps, and a warmup of a quarter of them is 6.
    assert summary["plan"]["tokens_per_step"] == 128
    assert summary["steps"] == summary["plan"]["max_steps"] == 24
    assert summary["plan"]["warmup_steps"] == 6
    assert summary["plan"]["seq_len_warmup_steps"] == 7  # train.seq_len_warmup 0.3 of 24 steps: short contexts first
    # ... and 24 optimizer steps were taken: the run's loss curve has a point for each of steps 1 to 24.
    client = client_for(project)
    run = client.search_runs([client.get_experiment_by_name("ultrathink").experiment_id])[0]
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "train_loss")) == list(range(1, 25))
    # compile auto measured the eager step (a probe) and found the run far too short for a compile to pay.
    (plan,) = recorded_plans(project, "3000tokens")
    assert plan["probe"]["step_seconds"] > 0 and plan["compile"] is False and summary["plan"]["compile"] is False


def test_attention_auto_times_each_kernel_and_keeps_the_default_unless_clearly_faster(monkeypatch):
    from ultrathink.model import kernels
    from ultrathink.model.kernels import AttentionKernel, choose_attention

    torch.manual_seed(3)
    before = torch.get_rng_state()
    chosen, timings = choose_attention("auto", 4, 4, 2, 64, 16, 0.0, "cpu", torch.bfloat16)
    assert torch.equal(torch.get_rng_state(), before)
    assert list(timings) == ["torch/fp32", "flash", "flash/fp32", "math", "math/fp32", "matmul"]
    assert all(0 < ms < math.inf for ms in timings.values())
    # Whatever the machine measured: the default, or a kernel at least 10% faster than the default.
    assert chosen == AttentionKernel() or timings[kernels.label(chosen)] * 1.1 <= timings["torch/fp32"], timings
    # With attention dropout the CPU flash kernel cannot run: it is left out, not chosen.
    _, with_dropout = choose_attention("auto", 4, 4, 2, 64, 16, 0.1, "cpu", torch.bfloat16)
    assert "flash" not in with_dropout and "math" in with_dropout
    assert choose_attention("math", 4, 4, 2, 64, 16, 0.0, "cpu", None) == (AttentionKernel("math", False), {})
    # In fp32 matmul is the math kernel's arithmetic again: not a candidate, so a near-tie cannot flip to it.
    assert [kernels.label(k) for k in kernels.candidates("auto", "cpu", None)] == ["torch/fp32", "flash", "math"]

    # Known timings (ms per call), worked out by hand: the kernels are tried in the order above, and one replaces
    # the pick so far only when it is at least 10% faster than that pick.
    def pick(ms: dict) -> AttentionKernel:
        monkeypatch.setattr(kernels, "_time_once", lambda option, *rest: ms[kernels.label(option)] / 1e3)
        picked, measured = choose_attention("auto", 2, 2, 1, 16, 8, 0.0, "cpu", torch.bfloat16)
        assert measured == pytest.approx(ms)
        return picked

    # flash is 5% faster than the default: kept; flash/fp32 25% faster: taken; math is the fastest of all but only
    # 7% faster than flash/fp32: flash/fp32 stays.
    assert pick({"torch/fp32": 10.0, "flash": 9.5, "flash/fp32": 8.0, "math": 7.5, "math/fp32": 12.0,
                 "matmul": 7.4}) == AttentionKernel("flash", True)
    # Every alternative within 10% of the default: the default.
    assert pick({"torch/fp32": 10.0, "flash": 9.2, "flash/fp32": 9.3, "math": 9.4, "math/fp32": 9.5,
                 "matmul": 9.6}) == AttentionKernel()
    # A chain: flash (8.0) beats the default, math (7.0) beats flash by 14%, math/fp32 (6.5) beats math by only 8%.
    assert pick({"torch/fp32": 10.0, "flash": 8.0, "flash/fp32": 7.5, "math": 7.0, "math/fp32": 6.5,
                 "matmul": 6.8}) == AttentionKernel("math", False)
    # bf16 matmuls at twice fp32's rate (an AVX512-BF16 CPU): matmul, last in the order, beats the rest.
    assert pick({"torch/fp32": 6.2, "flash": 10.9, "flash/fp32": 6.7, "math": 6.9, "math/fp32": 8.0,
                 "matmul": 3.5}) == AttentionKernel("matmul", False)


def test_a_near_tie_between_kernels_is_kept_by_the_order_not_by_the_lower_timing(monkeypatch):
    """The dropout nondeterminism's root cause: under dropout the candidates left (torch's own, which is math in
    fp32, math in bf16 and the bf16 matmul kernel) time within noise of each other, and the lowest timing used to
    win among them, so runs of one configuration trained in different dtypes. Timings within MIN_GAIN keep the
    earlier kernel."""
    from ultrathink.model import kernels

    def timer(times):
        return lambda option, *rest: next(times)

    noisy = iter([0.0] * 3 + [0.0110, 0.0102, 0.0104] * 5)  # warm-up runs, then math (bf16) looks 7% faster
    monkeypatch.setattr(kernels, "_time_once", timer(noisy))
    chosen, timings = kernels.choose_attention("auto", 2, 2, 1, 16, 8, 0.1, "cpu", torch.bfloat16)
    assert list(timings) == ["torch/fp32", "math", "matmul"] and chosen == kernels.AttentionKernel()
    clear = iter([0.0] * 3 + [0.0200, 0.0100, 0.0095] * 5)  # math 2× faster: a real gain is taken
    monkeypatch.setattr(kernels, "_time_once", timer(clear))
    assert kernels.choose_attention("auto", 2, 2, 1, 16, 8, 0.1, "cpu", torch.bfloat16)[0] == \
        kernels.AttentionKernel("math", False)


def test_under_dropout_math_in_the_defaults_dtype_is_not_timed_against_it(monkeypatch):
    """Under attention dropout torch's choice on a CPU is the math kernel, so math in the same dtype trains alike;
    without dropout (validation) the default runs flash. A timing that picked math by noise made two runs of one
    fp32 configuration, trained bit for bit alike, report validation losses 5e-7 apart (test_resume_kill failed
    so in CI). Such a twin is not a candidate: in fp32 under dropout nothing is timed at all."""
    from ultrathink.model import kernels

    monkeypatch.setattr(kernels, "_time_once", lambda option, *rest: 0.001 if option.backend == "math" else 0.01)
    assert kernels.choose_attention("auto", 2, 4, 2, 16, 8, 0.1, "cpu", None) == (kernels.AttentionKernel(), {})
    assert [kernels.label(k) for k in kernels.candidates("auto", "cpu", torch.bfloat16, 0.1)] == \
        ["torch/fp32", "math", "matmul"]
    monkeypatch.undo()

    # The premise, on this torch: under dropout the default and math compute the same; without it they differ.
    q, k, v = torch.randn(3, 2, 4, 16, 8, generator=torch.Generator().manual_seed(0))
    def attend(kernel, dropout):
        torch.manual_seed(1)
        return kernel.attend(q, k, v, is_causal=True, dropout_p=dropout)
    default, math_kernel = kernels.AttentionKernel(), kernels.AttentionKernel("math", False)
    assert torch.equal(attend(default, 0.1), attend(math_kernel, 0.1))
    assert not torch.equal(attend(default, 0.0), attend(math_kernel, 0.0))


CACHED_PREFIX = torch.ones(5, 7, dtype=torch.bool).tril(diagonal=2)  # 5 new tokens after 2 cached, causally
MATMUL_CASES = {  # (kv heads, keys, SDPA's arguments) for 4 query heads of 5 tokens
    "causal": (4, 5, dict(is_causal=True)),
    "a boolean mask over a cached prefix": (4, 7, dict(attn_mask=CACHED_PREFIX)),
    "an additive mask": (4, 7, dict(attn_mask=torch.linspace(-3, 3, 35, dtype=torch.float64).view(5, 7))),
    "grouped-query, causal": (2, 5, dict(is_causal=True, enable_gqa=True)),
    "grouped-query, a boolean mask over a cached prefix": (2, 7, dict(attn_mask=CACHED_PREFIX, enable_gqa=True)),
    "grouped-query, an additive mask per query head": (
        1, 7, dict(attn_mask=torch.linspace(-3, 3, 140, dtype=torch.float64).view(4, 5, 7), enable_gqa=True)),
    "a scale of its own": (4, 5, dict(scale=0.3)),
    "no mask": (4, 5, {})}


def assert_matmul_attention_is_sdpa(q, k, v, compiled=None, **sdpa) -> torch.Tensor:
    """matmul_attention's outputs and gradients (or those of `compiled`, a compiled matmul_attention) equal
    F.scaled_dot_product_attention's, in float64 to the last bits (the gradient of an uneven weighting of the
    outputs, so each output counts); SDPA's output."""
    from ultrathink.model.kernels import matmul_attention

    outputs, grads = [], []
    for attention in (compiled or matmul_attention, torch.nn.functional.scaled_dot_product_attention):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        y = attention(*leaves, **sdpa)
        y.backward(torch.ones_like(y).cumsum(-1))
        outputs.append(y.detach())
        grads.append([t.grad for t in leaves])
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-12, atol=1e-12)
    for ours, torchs in zip(*grads):
        torch.testing.assert_close(ours, torchs, rtol=1e-10, atol=1e-12)
    return outputs[1]


def test_matmul_attention_broadcasts_batch_dimensions_as_sdpa_does():
    """Keys and values shared by every sequence of a batch (batch dimension 1), grouped-query heads: SDPA's values
    and gradients in float64."""
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(3, 4, 5, 8, dtype=torch.float64, generator=generator)
    k, v = (torch.randn(1, 2, 5, 8, dtype=torch.float64, generator=generator) for _ in range(2))
    assert_matmul_attention_is_sdpa(q, k, v, is_causal=True, enable_gqa=True)


@pytest.mark.parametrize("case", MATMUL_CASES, ids=list(MATMUL_CASES))
def test_matmul_attention_computes_what_sdpa_computes_and_its_gradients(case):
    """train.attention matmul is F.scaled_dot_product_attention written out: the same outputs and gradients, in
    float64 to the last bits, for every argument the model passes (a causal window, a generation step's boolean mask
    over the cache, grouped-query heads) and the rest SDPA takes."""
    kv_heads, keys, kwargs = MATMUL_CASES[case]
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 8, dtype=torch.float64, generator=generator)
    k, v = (torch.randn(2, kv_heads, keys, 8, dtype=torch.float64, generator=generator) for _ in range(2))
    assert_matmul_attention_is_sdpa(q, k, v, **kwargs)


def test_grouped_query_attention_never_repeats_keys_and_values():
    """With fewer key heads than query heads, matmul attention reads each key and value head once for its group of
    query heads: no operator repeats them forward (repeat_interleave wrote them out with a clone), none sums their
    gradients back over copies; two matmuls forward, four backward. And it refuses what SDPA refuses: unequal heads
    without enable_gqa."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from ultrathink.model.kernels import matmul_attention

    class Calls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    q = torch.randn(2, 6, 16, 8, requires_grad=True)
    k, v = (torch.randn(2, 2, 16, 8, requires_grad=True) for _ in range(2))
    with Calls() as calls:
        y = matmul_attention(q, k, v, is_causal=True, enable_gqa=True)
        y.backward(torch.ones_like(y))
    repeating = {"repeat_interleave", "index_select", "repeat", "clone", "sum", "index_add"}
    assert not repeating & set(calls.names), calls.names
    assert calls.names.count("bmm") == 2 + 4
    with pytest.raises(ValueError, match="6 query heads and 2 key heads need enable_gqa"):
        matmul_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("length,kv_heads", [(600, 2), (1100, 1)], ids=["3 blocks of 256", "4 blocks, grouped"])
def test_a_long_causal_window_in_blocks_of_queries_computes_what_sdpa_computes(length, kv_heads):
    """Past CAUSAL_BLOCK_MIN tokens matmul_attention attends block by block, each block of queries to the keys up to
    its last one (600 tokens: 256 + 256 + 88; 1100: 4 × 275): the same outputs and gradients as SDPA's causal
    attention in float64, the last block shorter too; and its dropout still keeps the expectation."""
    from ultrathink.model.kernels import causal_block, matmul_attention

    assert [causal_block(n) for n in (128, 256, 600, 1100, 2048)] == [256, 256, 256, 275, 512]
    generator = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, length, 4, dtype=torch.float64, generator=generator)
    k, v = (torch.randn(1, kv_heads, length, 4, dtype=torch.float64, generator=generator) for _ in range(2))
    exact = assert_matmul_attention_is_sdpa(q, k, v, is_causal=True, enable_gqa=kv_heads != 2)

    torch.manual_seed(6)
    draws = torch.stack([matmul_attention(q, k, v, is_causal=True, dropout_p=0.5, enable_gqa=kv_heads != 2)
                         for _ in range(200)])
    assert not torch.allclose(draws[0, ..., -1, :], draws[1, ..., -1, :])  # the last block drops weights too
    assert (draws.mean(0) - exact).abs().mean() < 0.1 * exact.abs().mean()


def test_under_compile_the_causal_softmax_is_one_operator_with_sdpas_values():
    """Compiled, matmul attention's causal softmax is the opaque ultrathink::causal_softmax, whose mask is a tensor
    it reads (traced, Inductor rebuilt the mask from indices at every score: ultrathink/model/kernels.py), not a
    mask built in the graph; the operator's registration passes torch's checks (its fake tensor, its autograd, the
    blocks' offsets); and the compiled function computes SDPA's values and gradients in float64, a long window's
    blocks included."""
    from ultrathink.model.kernels import matmul_attention

    for dtype, first in ((torch.float64, 0), (torch.bfloat16, 3)):
        scores = torch.randn(2, 3, 4, 4 + first, dtype=dtype, requires_grad=True)
        torch.library.opcheck(torch.ops.ultrathink.causal_softmax, (scores, first))
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    generator = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 300, 4, dtype=torch.float64, generator=generator) for _ in range(3))
    compiled = torch.compile(matmul_attention, backend=recording, fullgraph=True)
    try:
        exact = assert_matmul_attention_is_sdpa(q, k, v, is_causal=True, compiled=compiled)
    finally:
        torch._dynamo.reset()
    assert exact.shape == q.shape and len(graphs) == 1
    # 256 queries against their 256 keys, then the last 44 against all 300: each block's softmax is the operator
    assert [line.split("causal_softmax")[1] for line in graphs[0].splitlines() if "causal_softmax" in line] == [
        "(scores, 0);  scores = None", "(scores_1, 256);  scores_1 = None"]
    assert "triu" not in graphs[0] and "torch.softmax" not in graphs[0]


def test_matmul_attention_runs_in_bf16_under_autocast_and_its_dropout_keeps_the_expectation():
    """The kernel's point: its matmuls take bf16 in and give bf16 out (the scores rounded to bf16 before the
    softmax), close to fp32 attention; and attention dropout, which it applies to the softmax's weights as SDPA does,
    drops weights at the rate asked and rescales the rest (the mean over draws is the undropped output)."""
    from ultrathink.model.kernels import AttentionKernel, matmul_attention

    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, 16, 8, generator=generator) for _ in range(3))
    exact = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fast = AttentionKernel("matmul", False).attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), is_causal=True)
    assert fast.dtype == torch.bfloat16
    torch.testing.assert_close(fast.float(), exact, rtol=0.05, atol=0.03)
    assert not torch.equal(fast.float(), exact)  # it did compute in bf16

    torch.manual_seed(2)
    draws = torch.stack([matmul_attention(q, k, v, is_causal=True, dropout_p=0.5) for _ in range(400)])
    assert not torch.allclose(draws[0], draws[1])
    assert (draws.mean(0) - exact).abs().mean() < 0.1 * exact.abs().mean()


def test_the_model_with_the_matmul_kernel_gives_the_default_kernels_logits_with_and_without_a_cache():
    """Trained with matmul attention, a model computes what it does with torch's kernel: its whole forward, and a
    generation step that reads a KV cache (the boolean mask path)."""
    from ultrathink.model import KVCache, UltraThink
    from ultrathink.model.kernels import AttentionKernel

    torch.manual_seed(4)
    model = UltraThink(ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=16, dropout=0.0),
                       50).eval()
    idx = torch.randint(0, 50, (2, 12))
    logits = {}
    for kernel in (AttentionKernel(), AttentionKernel("matmul", False)):
        model.use_attention(kernel)
        with torch.no_grad():
            whole = model(idx).logits
            cache = KVCache(2)
            stepped = torch.cat([model(idx[:, :8], cache=cache).logits, model(idx[:, 8:], cache=cache).logits], 1)
        torch.testing.assert_close(stepped, whole, rtol=1e-4, atol=1e-5)
        logits[kernel.backend] = whole
    torch.testing.assert_close(logits["matmul"], logits["torch"], rtol=1e-5, atol=1e-6)


def test_the_attention_kernel_is_part_of_a_checkpoint_and_comes_back_on_resume(tmp_path):
    from test_train import make_trainer
    from ultrathink.model.kernels import AttentionKernel

    trainer = make_trainer(tmp_path, 5, attention="flash", model_cfg=ModelConfig(
        d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, seq_len=16, dropout=0.0))
    trainer.fit()
    resumed = make_trainer(tmp_path, 5, attention="math", model_cfg=trainer.model.cfg)
    resumed.checkpoints = trainer.checkpoints
    assert resumed.resume() == 5
    assert resumed.model.attention_kernel() == AttentionKernel("flash", False)
    assert all(m.kernel == AttentionKernel("flash", False) for m in resumed.model.modules() if hasattr(m, "kernel"))


def test_a_kernel_that_cannot_run_is_logged_with_its_error_and_out_of_memory_stops_the_choice(monkeypatch, caplog):
    """A kernel with no implementation for the case is skipped, and the log says which and why; running out of
    memory is not such a case (the run's shape does not fit), so it is raised, not skipped."""
    from ultrathink.model import kernels

    def flash_cannot(option, *rest):
        if option.backend == "flash":
            raise RuntimeError("No available kernel. Aborting execution.\nmore detail")
        return 0.01

    monkeypatch.setattr(kernels, "_time_once", flash_cannot)
    with caplog.at_level("INFO", logger="ultrathink.model.kernels"):
        chosen, timings = kernels.choose_attention("auto", 2, 2, 1, 16, 8, 0.0, "cpu", torch.bfloat16)
    assert chosen.backend != "flash" and not any(k.startswith("flash") for k in timings)
    assert "flash" in caplog.text and "cannot run this case (No available kernel. Aborting execution.)" in caplog.text

    def out_of_memory(option, *rest):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(kernels, "_time_once", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate"):
        kernels.choose_attention("auto", 2, 2, 1, 16, 8, 0.0, "cpu", torch.bfloat16)
