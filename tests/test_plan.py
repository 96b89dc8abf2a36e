"""The plan book (ultrathink/train/plan.py): a configuration is planned once per machine class and read back after;
another class decides for itself and says so in one line; a book that cannot be read is named."""

import json
import logging
import re
import sysconfig
from unittest import mock

import numpy as np
import pytest
from torch._inductor import config as inductor_config

from ultrathink.config import ModelConfig, TrainConfig
from ultrathink.errors import StageError
from ultrathink.train.budget import Probe
from ultrathink.train import plan as plan_module
from ultrathink.train.plan import PlanBook, cpu_isa, machine_class, plan_run

# No dropout: under it a CPU in fp32 has one attention kernel (torch's choice is math), and auto has none to time.
MODEL = ModelConfig(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, seq_len=16, dropout=0.0)
TRAIN = TrainConfig(max_steps=20, warmup_steps=2, batch_size=4)  # precision and attention: auto


def tokens(n: int) -> np.ndarray:
    return np.resize(np.random.default_rng(0).integers(0, 60, 41), n).astype(np.uint16)


def planned(book: PlanBook):
    return plan_run(MODEL, TRAIN, 64, tokens(4000), tokens(600), "cpu", 1, book)


def test_a_configuration_is_measured_once_then_read_back(tmp_path, monkeypatch):
    book = PlanBook(tmp_path / "plans/train.json")
    first = planned(book)
    assert first.measured and first.plan.precision in ("fp32", "bf16") and first.plan.machine == machine_class("cpu")
    assert first.plan.attention_ms  # attention auto timed its candidates
    monkeypatch.setattr(plan_module, "decide", lambda *a, **k: pytest.fail("a recorded plan was measured again"))
    monkeypatch.setattr(plan_module, "_measure_peak", lambda *a: pytest.fail("the recorded matmul peak was measured"))
    again = planned(book)
    assert not again.measured and again.plan == first.plan and again.key == first.key
    assert again.peak_flops == first.peak_flops
    # Another configuration is another entry: it is planned (measured) on its own.
    monkeypatch.undo()
    other = plan_run(MODEL, TRAIN.model_copy(update={"batch_size": 2}), 64, tokens(4000), tokens(600), "cpu", 1,
                     book)
    assert other.measured and other.key != first.key
    assert len(json.loads(book.path.read_text())[first.plan.machine]["plans"]) == 2


def test_a_set_precision_measures_only_its_own_peak_and_auto_measures_the_rest(tmp_path, monkeypatch):
    book = PlanBook(tmp_path / "plans/train.json")
    measured, measure = [], plan_module._measure_peak
    monkeypatch.setattr(plan_module, "_measure_peak",
                        lambda name, device: measured.append(name) or measure(name, device))  # the real one, counted
    fp32 = plan_run(MODEL, TRAIN.model_copy(update={"precision": "fp32"}), 64, tokens(4000), tokens(600), "cpu", 1,
                    book)
    machine = fp32.plan.machine
    assert measured == ["fp32"] and book.matmul_gflops(machine).keys() == {"fp32"}
    assert fp32.peak_flops == book.matmul_gflops(machine)["fp32"] * 1e9  # MFU's denominator
    auto = planned(book)
    assert measured == ["fp32", "bf16"] and book.matmul_gflops(machine).keys() == {"fp32", "bf16"}
    assert auto.plan.precision in ("fp32", "bf16")


def test_bookkeeping_reads_the_recorded_plan_and_a_timed_cadence_is_planned_again(tmp_path, monkeypatch):
    """A knob that names no checkpoint's configuration (train.calibrate, select, threads, ...) reads back the plan
    its run recorded: a plan measured again may decide otherwise on a busy machine, and its checkpoints would then
    not resume. Validation's cadence is planned under a time budget (which pays for it): there, changing it is another
    entry."""
    book = PlanBook(tmp_path / "plans/train.json")
    first = planned(book)
    monkeypatch.setattr(plan_module, "decide", lambda *a, **k: pytest.fail("a bookkeeping change was planned again"))
    for change in ({"calibrate": False}, {"select": "last"}, {"threads": 1}, {"log_every": 7}, {"max_bad_steps": 3}):
        again = plan_run(MODEL, TRAIN.model_copy(update=change), 64, tokens(4000), tokens(600), "cpu", 1, book)
        assert not again.measured and again.key == first.key and again.plan == first.plan, change
    budget = TRAIN.model_copy(update={"max_steps": None, "budget": "30s"})
    for change in ({"eval_every": 5}, {"eval_batches": 1}, {"checkpoint_every": 5}):
        key = plan_module.configuration_key(MODEL, budget.model_copy(update=change), 64, 4000, 600, 1)
        assert key != plan_module.configuration_key(MODEL, budget, 64, 4000, 600, 1), change
        # Without a time budget the cadence plans nothing (fine-tuning's finetune.eval_every, say): the same key.
        steps = plan_module.configuration_key(MODEL, TRAIN.model_copy(update=change), 64, 4000, 600, 1)
        assert steps == first.key, change


def test_a_sweep_of_knobs_no_timing_reads_shares_one_plan_and_a_timed_knob_does_not(tmp_path, monkeypatch):
    """The learning rate, the seed, the final rate's share, Adam's betas and the embedding's init change the weights
    but nothing a plan measures or decides: runs that differ only in them read one plan (under a time budget: one
    shape, one batch, the same steps). A knob a step's time depends on is another configuration."""
    book = PlanBook(tmp_path / "plans/train.json")
    first = planned(book)
    monkeypatch.setattr(plan_module, "decide", lambda *a, **k: pytest.fail("a sweep's run was planned again"))
    sweep = ({"lr": 3e-4}, {"seed": 7}, {"min_lr_ratio": 0.0}, {"beta1": 0.9}, {"beta2": 0.99},
             {"embedding_init": "normal"})
    for change in sweep:
        again = plan_run(MODEL, TRAIN.model_copy(update=change), 64, tokens(4000), tokens(600), "cpu", 1, book)
        assert not again.measured and again.key == first.key and again.plan == first.plan, change
    assert plan_module.NUMERICS_ONLY == {key for change in sweep for key in change}  # each of them, and no other
    budget = TRAIN.model_copy(update={"max_steps": None, "budget": "30s"})
    for change in sweep:
        key = plan_module.configuration_key(MODEL, budget.model_copy(update=change), 64, 4000, 600, 1)
        assert key == plan_module.configuration_key(MODEL, budget, 64, 4000, 600, 1), change
    for change in ({"optimizer": "muon"}, {"grad_clip": 0.0}, {"ema_horizon": 0.0}, {"schedule": "cosine"},
                   {"weight_decay": 0.5}, {"warmup_fraction": 0.2}):
        key = plan_module.configuration_key(MODEL, budget.model_copy(update=change), 64, 4000, 600, 1)
        assert key != plan_module.configuration_key(MODEL, budget, 64, 4000, 600, 1), change


def test_short_contexts_first_are_planned_for_a_corpus_read_many_times_and_a_set_share_wins(tmp_path):
    book = PlanBook(tmp_path / "train.json")
    settings = {"precision": "fp32", "attention": "torch", "compile": False}  # nothing to measure

    def plan(**train):
        return plan_run(MODEL, TRAIN.model_copy(update=settings | train), 64, tokens(4000), tokens(600), "cpu", 1,
                        book).plan

    # 64 tokens a step over a 4000-token corpus: 20 steps read it 0.32 times, 490 steps 7.84, 500 steps 8.
    assert plan().seq_len_warmup_steps == 0 == plan().decisions()["seq_len_warmup_steps"]
    assert plan(max_steps=490).seq_len_warmup_steps == 0
    many = plan(max_steps=500)
    assert many.seq_len_warmup_steps == 150 == many.decisions()["seq_len_warmup_steps"]  # 0.3 of the steps
    assert many.mlflow_params()["plan.seq_len_warmup_steps"] == 150
    assert plan(seq_len_warmup=0.5).seq_len_warmup_steps == 10 and plan(max_steps=500, seq_len_warmup=0.0)\
        .seq_len_warmup_steps == 0
    assert plan(max_steps=500, compile=True).seq_len_warmup_steps == 0  # each context length would recompile


def test_another_machine_class_decides_for_itself_and_says_so(tmp_path, caplog):
    book = PlanBook(tmp_path / "train.json")
    first = planned(book)
    recorded = json.loads(book.path.read_text())
    elsewhere = "cpu/GenuineIntel/amx_bf16/56 threads/torch 2.13"
    book.path.write_text(json.dumps({elsewhere: recorded[first.plan.machine]}))  # only another class has it
    with caplog.at_level(logging.WARNING, logger="ultrathink.train.plan"):
        here = planned(book)
    assert here.measured and list(here.others) == [elsewhere]
    (line,) = [r.message for r in caplog.records if "is not the class" in r.message]
    assert elsewhere in line and here.plan.machine in line and "The weights will differ" in line
    assert set(json.loads(book.path.read_text())) == {elsewhere, here.plan.machine}  # recorded beside it


def no_compiler(tmp_path):
    """Inductor's compiler setting pointed at a file that is not there: a slim container's CPU."""
    return (inductor_config.patch({"cpp.cxx": (None, str(tmp_path / "no-such-g++"))}),
            r"no working C\+\+ compiler \(.*no-such-g\+\+ tried")


def no_compiler_named_alone(tmp_path):
    """The same, the setting one name rather than a list to search (as a user may set it)."""
    missing = str(tmp_path / "no-such-clang++")
    return (inductor_config.patch({"cpp.cxx": missing}),
            rf"no working C\+\+ compiler \({re.escape(missing)} tried")


def no_python_headers(tmp_path):
    """This Python's include folders, as Inductor reads them from sysconfig, without Python.h: a system Python
    without its development package."""
    get_path = sysconfig.get_path

    def headerless(name, *args, **kwargs):
        return str(tmp_path) if name == "include" else get_path(name, *args, **kwargs)

    return (mock.patch.object(sysconfig, "get_path", headerless),
            rf"no Python headers \(Python.h is in none of {re.escape(str(tmp_path))}")


@pytest.mark.parametrize("blocked", [no_compiler, no_compiler_named_alone, no_python_headers])
def test_a_cpu_that_cannot_compile_is_a_class_of_its_own_that_plans_eagerly_and_refuses_compile_true(
        blocked, tmp_path, caplog):
    """Inductor builds a compiled CPU step with a C++ compiler against the Python headers: a slim container has no
    compiler, a system Python without its development package no headers (torch.compile then fails at its first
    step). There train.compile auto trains eagerly even where compiling would pay (and says why), a plan recorded
    where a step could compile is not read back, and train.compile true stops before any measurement, naming what
    is missing."""
    book = PlanBook(tmp_path / "plans/train.json")
    # 20 minutes of 1-second steps: on a CPU the compile pays after 600 s of eager steps (budget.py).
    auto = TRAIN.model_copy(update={"max_steps": None, "budget": "20min", "precision": "fp32", "attention": "torch"})
    slow_step = Probe(step_seconds=1.0, first_steps_extra=1.0, eval_seconds=0.5, save_seconds=0.4, seconds=2.0)

    def plan(train, probe=lambda model, train, kernel: slow_step):
        return plan_run(MODEL, train, 64, tokens(4000), tokens(600), "cpu", 1, book, probe)

    with_compiler = plan(auto)
    assert with_compiler.measured and with_compiler.plan.compile
    blocking, reason = blocked(tmp_path)
    with blocking, caplog.at_level(logging.WARNING, logger="ultrathink.train.budget"):
        assert machine_class("cpu") == f"{with_compiler.plan.machine}/no torch.compile"
        without = plan(auto)
        assert without.measured and not without.plan.compile and without.plan.machine == machine_class("cpu")
        assert without.plan.max_steps == with_compiler.plan.max_steps and list(without.others) == \
            [with_compiler.plan.machine]
        (line,) = [r.message for r in caplog.records if "train.compile auto" in r.message]
        assert re.search(f"would pay .*{reason}.*training eagerly", line), line
        with pytest.raises(StageError, match=f"train.compile true: torch.compile cannot build a step on this cpu: "
                                             f"{reason}"):
            plan(auto.model_copy(update={"compile": True}),
                 probe=lambda *_: pytest.fail("a run that cannot compile was measured"))
    # Able to compile again: its own class's plan, read back, still compiles.
    again = plan(auto, probe=lambda *_: pytest.fail("the recorded plan was measured again"))
    assert not again.measured and again.plan == with_compiler.plan
    assert set(json.loads(book.path.read_text())) == {with_compiler.plan.machine, without.plan.machine}


def test_an_unreadable_book_is_named(tmp_path):
    path = tmp_path / "train.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="train.json: not a plan book"):
        planned(PlanBook(path))


def test_the_isa_is_the_widest_matmul_instruction_set():
    assert cpu_isa({"avx2", "avx512f", "avx512_bf16", "amx_bf16"}) == "amx_bf16"
    assert cpu_isa({"avx2", "avx512f", "avx512_bf16"}) == "avx512_bf16"
    assert cpu_isa({"avx2", "fma"}) == "avx2" and cpu_isa(set()) == "baseline"


def test_flash_attention_in_fp32_on_a_gpu_is_refused_before_training():
    from ultrathink.errors import StageError
    from ultrathink.train.plan import decide_attention

    with pytest.raises(StageError, match="train.attention flash has no fp32 kernel on a GPU.*train.precision bf16"):
        decide_attention("flash", MODEL, 4, "fp32", "cuda:0")  # a plain check: no GPU is touched
    kernel, timings = decide_attention("flash", MODEL, 4, "fp32", "cpu")  # the CPU has an fp32 flash kernel
    assert (kernel.backend, timings) == ("flash", {})
    assert decide_attention("flash", MODEL, 4, "bf16", "cuda:0")[0].backend == "flash"


class RankEnd:
    """One rank's end of Distributed.share (a broadcast from the main rank), in one process: what the main rank
    shares goes on `wire` as JSON carries it, and the other rank receives that."""

    def __init__(self, rank: int, wire: list):
        self.is_main, self.wire = rank == 0, wire

    def share(self, message):
        if self.is_main:
            self.wire.append(json.loads(json.dumps(message)))
            return message
        return self.wire.pop(0)


def test_the_other_ranks_follow_the_main_ranks_plan_and_its_peak_without_measuring(tmp_path, monkeypatch):
    wire, book = [], PlanBook(tmp_path / "plans/train.json")
    main = plan_module.plan_on_main(RankEnd(0, wire), lambda: planned(book))
    assert main.measured and main.peak_flops > 0
    monkeypatch.setattr(plan_module, "decide", lambda *a, **k: pytest.fail("a following rank planned"))
    monkeypatch.setattr(plan_module, "_measure_peak", lambda *a: pytest.fail("a following rank measured a peak"))
    other = plan_module.plan_on_main(RankEnd(1, wire), lambda: pytest.fail("a following rank decided"))
    assert other.plan == main.plan and other.measured
    # MFU's denominator is the main rank's: a rank measuring its own spends a second or more of CPU on it.
    assert other.peak_flops == main.peak_flops
