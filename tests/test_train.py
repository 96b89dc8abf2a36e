import math
from pathlib import Path

import numpy as np
import pytest
import torch

from ultrathink.config import ModelConfig, TrainConfig
from ultrathink.evaluate import bits_per_byte, unigram_cross_entropy
from ultrathink.model import UltraThink
from ultrathink.model.kernels import AttentionKernel, candidates, label
from ultrathink.train.checkpoint import CheckpointManager, Fingerprint
from ultrathink.train.loader import BatchLayout, BatchSplitError, ContextWarmup, TokenWindows, eval_batches
from ultrathink.train.optim import param_groups
from ultrathink.train.schedule import decay_from, lr_factor
from ultrathink.train.distributed import Distributed
from ultrathink.train.engine import build_engine, clip_grad_norm
from ultrathink.train.trainer import Deadline, NonFiniteLossError, Trainer, ready_model

MODEL = ModelConfig(d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, seq_len=16)
VOCAB = 50


def corpus(n=4000, seed=0) -> np.ndarray:
    """A learnable stream: a fixed random cycle of tokens, so next-token loss can fall far below ln(VOCAB)."""
    cycle = np.random.default_rng(seed).integers(0, VOCAB, 37)
    return np.resize(cycle, n).astype(np.uint16)


FP = Fingerprint("params", "data", "code")


def make_trainer(tmp_path, steps, seed=0, model_cfg=MODEL, fingerprint=FP, context=None, deadline=None,
                 **overrides) -> Trainer:
    settings = dict(max_steps=steps, batch_size=4, lr=1e-2, warmup_steps=2, weight_decay=0.1, eval_every=5,
                    eval_batches=2, checkpoint_every=5, log_every=5, precision="fp32", seed=seed)
    cfg = TrainConfig(**(settings | overrides))
    torch.manual_seed(seed)
    model = UltraThink(model_cfg, VOCAB)
    loader = TokenWindows(corpus(), model_cfg.seq_len, cfg.batch_size, cfg.seed, grad_accum=cfg.grad_accum)
    checkpoints = CheckpointManager(tmp_path / "ckpt", fingerprint, 2, cfg.keep_configs, extra={"optimizer": cfg.optimizer})
    dist = Distributed()
    engine = build_engine(ready_model(model, cfg, None, dist), cfg, dist)
    return Trainer(engine, loader, corpus(600, seed=0), cfg, checkpoints, context=context, deadline=deadline)


@pytest.mark.parametrize("schedule, expected", [
    ("cosine", [0.1, 1.0, 1.0, 0.55, 0.1]),
    ("linear", [0.1, 1.0, 1.0, 0.55, 0.1]),
    ("constant", [0.1, 1.0, 1.0, 1.0, 1.0]),
    ("wsd", [0.1, 1.0, 1.0, 1.0, 0.1]),
])
def test_schedules_warm_up_then_follow_their_shape(schedule, expected):
    cfg = TrainConfig(max_steps=100, warmup_steps=10, min_lr_ratio=0.1, schedule=schedule, decay_fraction=0.2)
    assert [lr_factor(s, cfg) for s in (0, 9, 10, 55, 100)] == pytest.approx(expected)
    if schedule == "wsd":  # stable until 80% of the post-warmup steps, then linear to the floor
        assert lr_factor(82, cfg) == pytest.approx(1.0) and lr_factor(91, cfg) == pytest.approx(0.55)


@pytest.mark.parametrize("warmup, step, fraction", [(10, 50, 0.2), (2, 13, 0.2), (0, 7, 0.3), (5, 333, 0.1)])
def test_a_decay_begun_early_keeps_the_steps_taken_and_takes_its_share_of_the_run(warmup, step, fraction):
    cfg = TrainConfig(max_steps=10_000, warmup_steps=warmup, min_lr_ratio=0.1, schedule="wsd", decay_fraction=fraction)
    total = decay_from(step, cfg)
    shortened = cfg.model_copy(update={"max_steps": total})
    assert [lr_factor(s, shortened) for s in range(step + 1)] == [lr_factor(s, cfg) for s in range(step + 1)]
    assert lr_factor(step + 1, shortened) < 1.0 and lr_factor(total, shortened) == pytest.approx(0.1)
    decaying = sum(lr_factor(s, shortened) < 1.0 for s in range(warmup, total))
    assert decaying / (total - warmup) == pytest.approx(fraction, abs=1.5 / (total - warmup))


def test_weight_decay_skips_norms_and_embeddings():
    model = UltraThink(MODEL, VOCAB)
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert any(p is model.embed.weight for p in no_decay["params"])
    assert all(p.dim() == 1 or p is model.embed.weight for p in no_decay["params"])
    assert all(p.dim() == 2 for p in decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_loader_covers_each_window_once_per_epoch_and_resumes():
    tokens = np.arange(16 * 8 + 1, dtype=np.uint16)  # 8 windows of 16
    loader = TokenWindows(tokens, 16, 2, seed=3)
    first = [next(loader)[0][:, 0].tolist() for _ in range(4)]
    assert sorted(sum(first, [])) == list(range(0, 128, 16))
    x, y = next(loader)
    assert torch.equal(x[:, 1:], y[:, :-1])
    state = loader.state_dict()
    expected = [next(loader)[0] for _ in range(3)]
    again = TokenWindows(tokens, 16, 2, seed=3)
    again.load_state_dict(state)
    assert all(torch.equal(a, next(again)[0]) for a in expected)


def test_later_epochs_cut_the_stream_from_other_offsets_and_resume_there():
    """The first epoch cuts windows from token 0, each later one from an offset drawn from (seed, epoch): every
    window still seq_len + 1 consecutive tokens of the stream, each epoch its 8 windows once; validation's fixed
    order never shifts; a run resumed inside a shifted epoch reads what the uninterrupted one reads."""
    tokens = np.arange(16 * 8 + 5, dtype=np.uint16)  # a token's value is its position: 8 windows of 16, 5 left over

    def epochs(loader, count):
        for _ in range(count):
            xs, ys = zip(*(next(loader) for _ in range(4)))  # 4 steps of 2 windows: one epoch
            x, y = torch.cat(xs), torch.cat(ys)
            assert torch.equal(x, x[:, :1] + torch.arange(16)) and torch.equal(y, x + 1)  # consecutive tokens
            yield sorted(x[:, 0].tolist())

    shuffled = list(epochs(TokenWindows(tokens, 16, 2, seed=3), 6))
    assert shuffled[0] == list(range(0, 128, 16))
    offsets = set()
    for starts in shuffled[1:]:
        assert len(set(starts)) == 8 and max(starts) <= len(tokens) - 17
        offset = max((s % 16 for s in starts), key=[s % 16 for s in starts].count)
        assert sum(s % 16 == offset for s in starts) >= 7  # all but a window wrapped past the end
        offsets.add(offset)
    assert len(offsets) >= 3 and offsets != {0}
    assert all(starts == list(range(0, 128, 16)) for starts in epochs(TokenWindows(tokens, 16, 2, 3, False), 3))
    loader = TokenWindows(tokens, 16, 2, seed=3)
    for _ in range(9):  # two epochs and one step into the third
        next(loader)
    state, expected = loader.state_dict(), [next(loader)[0] for _ in range(6)]
    again = TokenWindows(tokens, 16, 2, seed=3)
    again.load_state_dict(state)
    assert all(torch.equal(a, next(again)[0]) for a in expected)


def test_short_contexts_first_read_each_window_as_quarters_then_halves_of_the_same_tokens():
    warmup = ContextWarmup(steps=8, seq_len=16)
    assert [warmup.parts(step) for step in range(10)] == [4] * 4 + [2] * 4 + [1] * 2
    assert [ContextWarmup(3, 16).parts(step) for step in range(4)] == [4, 4, 2, 1]  # quarters while step < 1.5
    assert [ContextWarmup(8, 6).parts(step) for step in (0, 5, 8)] == [2, 2, 1]  # 6 tokens have no quarters
    assert [ContextWarmup(8, 7).parts(step) for step in (0, 5)] == [1, 1]  # an odd seq_len is never cut
    tokens = np.arange(16 * 8 + 1, dtype=np.uint16)  # a token's value is its position
    x, y = next(TokenWindows(tokens, 16, 2, seed=3))
    for step, parts in ((0, 4), (5, 2), (8, 1)):
        short_x, short_y = warmup.cut((x, y), step)
        assert short_x.shape == short_y.shape == (2 * parts, 16 // parts)
        assert torch.equal(short_y, short_x + 1)  # every target is still its input's next token
        assert torch.equal(short_x.reshape(2, 16), x) and torch.equal(short_y.reshape(2, 16), y)  # the same tokens


def test_a_trainer_with_short_contexts_first_feeds_them_and_resumes_inside_them(tmp_path):
    seen = []
    straight = make_trainer(tmp_path / "a", 12, context=ContextWarmup(8, MODEL.seq_len))
    straight.model.register_forward_pre_hook(lambda m, args: seen.append(tuple(args[0].shape)) if m.training else None)
    straight.fit()
    assert seen == [(16, 4)] * 4 + [(8, 8)] * 4 + [(4, 16)] * 4  # batch 4 of 16 tokens, cut in 4, then 2
    whole = make_trainer(tmp_path / "c", 12)
    whole.fit()
    assert not torch.equal(whole.model.embed.weight, straight.model.embed.weight)  # the cuts changed the training

    first = make_trainer(tmp_path / "b", 12, context=ContextWarmup(8, MODEL.seq_len))
    while first.step < 6:  # killed after a checkpoint in the halves
        first.train_step()
    first.save_checkpoint()
    resumed = make_trainer(tmp_path / "b", 12, seed=99, context=ContextWarmup(8, MODEL.seq_len))
    assert resumed.resume() == 6
    resumed.fit()
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name


def test_the_global_batch_is_the_same_on_any_number_of_ranks_and_each_rank_reads_its_own_part():
    tokens = np.arange(16 * 12 + 1, dtype=np.uint16)  # 12 windows of 16
    starts = lambda batch: batch[0][:, 0].tolist()  # noqa: E731
    one = TokenWindows(tokens, 16, 2, seed=1, grad_accum=2)  # 4 sequences per step, in 2 micro-batches of 2
    # 3 steps an epoch: the third epoch's windows are cut from an offset, which every rank must share
    steps_one = [starts(next(one)) + starts(next(one)) for _ in range(8)]
    assert any(start % 16 for step in steps_one[6:] for start in step)
    for world in (2, 4):
        ranks = [TokenWindows(tokens, 16, 2, seed=1, grad_accum=2, rank=r, world_size=world) for r in range(world)]
        assert ranks[0].layout == BatchLayout(sequences=4, world_size=world, micro=4 // world, accum=1)
        for expected in steps_one:  # rank by rank, the step's windows in the order one process reads them
            assert sum((starts(next(loader)) for loader in ranks), []) == expected
        assert all(loader.state_dict() == one.state_dict() for loader in ranks)  # one position, any world size


def test_a_loader_that_reads_other_micro_batches_than_grad_accum_says_is_refused():
    cfg = TrainConfig(batch_size=4, grad_accum=2, precision="fp32", weight_decay=0.1)
    dist = Distributed()
    engine = build_engine(ready_model(UltraThink(MODEL, VOCAB), cfg, None, dist), cfg, dist)
    loader = TokenWindows(corpus(), MODEL.seq_len, cfg.batch_size, cfg.seed)  # grad_accum forgotten
    with pytest.raises(ValueError, match="reads 1 micro-batches per step and train.grad_accum 2 on 1 ranks means 2"):
        Trainer(engine, loader, corpus(600, seed=0), cfg, CheckpointManager("unused", FP, 1))


def test_a_batch_layout_keeps_micro_batches_at_most_batch_size_and_refuses_an_uneven_split():
    assert BatchLayout.split(16, 1, 1) == BatchLayout(16, 1, 16, 1)
    assert BatchLayout.split(4, 6, 2) == BatchLayout(24, 2, 4, 3)  # 12 per rank: 3 micro-batches of 4
    assert BatchLayout.split(4, 3, 2) == BatchLayout(12, 2, 3, 2)  # 6 per rank: 2 of 3, none over 4
    with pytest.raises(BatchSplitError, match=r"12 sequences \(train.batch_size 4 × train.grad_accum 3\) cannot be "
                       r"split evenly over 5 ranks"):
        BatchLayout.split(4, 3, 5)


def test_too_small_corpus_is_a_clear_error():
    with pytest.raises(ValueError, match="fewer than one batch"):
        TokenWindows(np.arange(20, dtype=np.uint16), 16, 4, seed=0)


def test_eval_batches_are_fixed():
    a = [x for x, _ in eval_batches(corpus(600), 16, 4)]
    b = [x for x, _ in eval_batches(corpus(600), 16, 4)]
    assert len(a) == 9 and all(torch.equal(p, q) for p, q in zip(a, b))


def test_training_learns_the_stream(tmp_path):
    trainer = make_trainer(tmp_path, 40)
    before = trainer.validate()
    result = trainer.fit()
    assert before > 3.5  # about ln(50) = 3.9 at initialisation
    assert result.history[-1]["val_loss"] < 1.0
    assert [h["step"] for h in result.history] == [5, 10, 15, 20, 25, 30, 35, 40]


def test_resume_is_bitwise_identical_to_an_uninterrupted_run(tmp_path):
    straight = make_trainer(tmp_path / "a", 20)
    straight.fit()

    first = make_trainer(tmp_path / "b", 20)
    while first.step < 10:  # the run that gets killed after its checkpoint at step 10
        first.train_step()
    first.save_checkpoint()

    resumed = make_trainer(tmp_path / "b", 20, seed=99)  # a different seed: everything must come from the checkpoint
    assert resumed.resume() == 10
    resumed.fit()
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name


def test_other_code_never_resumes_and_going_back_resumes_where_it_stopped(tmp_path, caplog):
    first = make_trainer(tmp_path, 10)
    first.fit()
    other_code = Fingerprint("params", "data", "code-with-a-changed-line")
    changed = make_trainer(tmp_path, 10, fingerprint=other_code)
    with caplog.at_level("WARNING"):
        assert changed.resume() is None
    assert "made with other code than this run" in caplog.text and first.checkpoints.directory.name in caplog.text
    result = changed.fit()
    assert result.step == 10 and result.resumed_from is None  # trained every step with the new code
    # The first configuration's checkpoints are all still there: going back resumes at its last step.
    assert [p.name for p in sorted(first.checkpoints.directory.iterdir()) if p.name.startswith("step")] == \
        ["step_00000005", "step_00000010"]
    again = make_trainer(tmp_path, 10)
    assert again.resume() == 10
    assert all(torch.equal(a, b) for a, b in zip(first.model.state_dict().values(), again.model.state_dict().values()))


def test_resume_false_starts_over_and_keeps_the_old_checkpoints(tmp_path):
    make_trainer(tmp_path, 5).fit()
    fresh = make_trainer(tmp_path, 5, resume=False)
    assert fresh.resume() is None
    aside = [p for p in (tmp_path / "ckpt").iterdir() if ".set-aside-" in p.name]
    assert len(aside) == 1 and (aside[0] / "step_00000005" / "model.safetensors").is_file()
    assert fresh.checkpoints.latest() is None


def test_least_recently_used_configurations_beyond_keep_configs_are_removed(tmp_path):
    folders = []
    for i in range(4):
        trainer = make_trainer(tmp_path, 5, fingerprint=Fingerprint(f"params{i}", "data", "code"), keep_configs=3)
        trainer.fit()
        folders.append(trainer.checkpoints.directory)
    assert [f.exists() for f in folders] == [False, True, True, True]


def test_checkpoints_keep_the_latest_and_skip_corrupt_ones(tmp_path, caplog):
    trainer = make_trainer(tmp_path, 15)
    trainer.fit()
    manager = trainer.checkpoints
    assert [p.name for _, p in manager._step_dirs()] == ["step_00000015", "step_00000010"]
    (manager.directory / ".step_00000020.partial").mkdir()  # a write killed half-way is never picked
    state = manager.directory / "step_00000015" / "state.pt"
    state.write_bytes(state.read_bytes()[:100])  # truncated
    latest = manager.latest()
    assert latest.step == 10
    assert "fails its checksum" in caplog.text
    assert latest.load_state()["step"] == 10


def test_bits_per_byte_and_unigram_baseline():
    assert bits_per_byte(math.log(2), n_tokens=10, n_bytes=10) == pytest.approx(1.0)
    assert bits_per_byte(math.log(2), n_tokens=10, n_bytes=40) == pytest.approx(0.25)
    uniform = np.arange(100, dtype=np.uint16) % 4
    assert unigram_cross_entropy(uniform, uniform, 4) == pytest.approx(math.log(4))


@pytest.mark.parametrize("optimizer", ["lion", "muon"])
def test_other_optimizers_learn_and_resume_exactly(tmp_path, optimizer):
    straight = make_trainer(tmp_path / "a", 10, optimizer=optimizer, lr=3e-3)
    before = straight.validate()
    straight.fit()
    assert straight.history[-1]["val_loss"] < before - 0.4
    killed = make_trainer(tmp_path / "b", 10, optimizer=optimizer, lr=3e-3)
    while killed.step < 5:
        killed.train_step()
    killed.save_checkpoint()
    resumed = make_trainer(tmp_path / "b", 10, optimizer=optimizer, lr=3e-3)
    assert resumed.resume() == 5
    resumed.fit()
    assert all(torch.equal(a, b) for a, b in zip(straight.model.state_dict().values(),
                                                  resumed.model.state_dict().values()))


def poison(trainer: Trainer, steps: set[int]) -> None:
    """Make the loss NaN on the given (1-based) optimizer steps, as a bad batch or an overflow would."""
    calls = {"n": 0}

    def hook(module, args, output):
        calls["n"] += 1
        return output * float("nan") if calls["n"] in steps else output

    trainer.model.embed.register_forward_hook(hook)


def test_non_finite_steps_are_skipped_and_counted(tmp_path):
    trainer = make_trainer(tmp_path, 10, eval_every=100)
    poison(trainer, {3, 4})
    result = trainer.fit()
    assert result.step == 10 and result.skipped_steps == 2
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_too_many_bad_steps_stop_without_a_nan_checkpoint(tmp_path):
    trainer = make_trainer(tmp_path, 20, max_bad_steps=3)
    poison(trainer, set(range(7, 100)))
    with pytest.raises(NonFiniteLossError, match="3 consecutive steps"):
        trainer.fit()
    latest = trainer.checkpoints.latest()
    assert latest.step == 5  # the last good one; nothing written from the NaN steps
    assert all(torch.isfinite(t).all() for t in latest.load_weights().values())


def test_early_stopping_keeps_the_best_model(tmp_path):
    trainer = make_trainer(tmp_path, 200, eval_every=5, early_stopping_patience=2, lr=5e-2,
                           warmup_steps=1, min_lr_ratio=1.0)
    best_seen = []
    original = trainer.validate
    # Validation gets worse after the second pass: patience 2 stops the run two passes later.
    trainer.validate = lambda: best_seen.append(original()) or [3.0, 2.0, 2.5, 2.6, 2.7][len(best_seen) - 1]
    result = trainer.fit()
    assert result.stopped_early and result.step == 20 and result.best_val_loss == 2.0
    best = trainer.checkpoints.best()
    assert best.step == 10
    assert trainer.select_weights() == 10
    kept = trainer.model.state_dict()
    assert all(torch.equal(w, kept[name]) for name, w in best.load_weights().items())
    # The decision survives a resume: the run stays stopped instead of training on to step 200.
    resumed = make_trainer(tmp_path, 200, eval_every=5, early_stopping_patience=2, lr=5e-2, warmup_steps=1,
                           min_lr_ratio=1.0)
    assert resumed.resume() == 20
    again = resumed.fit()
    assert again.step == 20 and again.stopped_early and resumed.select_weights() == 10


def plateau_trainer(path, steps, validations, **overrides):
    """A WSD run validated and checkpointed every 20 steps (an epoch of the corpus is 62), whose validation losses
    are `validations` in turn."""
    settings = dict(eval_every=20, checkpoint_every=20, log_every=1, decay_patience=1, warmup_steps=2,
                    min_lr_ratio=0.1, decay_fraction=0.2) | overrides
    trainer = make_trainer(path, steps, **settings)
    scripted = iter(validations)
    trainer.validate = lambda: next(scripted)
    return trainer


def same_weights(a: Trainer, b: Trainer) -> bool:
    theirs = b.model.state_dict()
    return all(torch.equal(w, theirs[name]) for name, w in a.model.state_dict().items())


PLATEAU = [3.0, 2.0, 1.5, 1.8, 1.4]  # best at step 60; step 80 (in the second epoch) has no gain


def test_a_plateau_goes_back_to_the_best_step_and_decays_from_there(tmp_path):
    """train.decay_patience 1: step 80's pass without gain sends the run back to step 60's checkpoint, whose decay
    takes a fifth of the run: it ends at step 75, with the weights of a run planned for 75 steps from the start
    (the 20 steps it went back over leave no trace), and no checkpoint past its end."""
    trainer = plateau_trainer(tmp_path / "plateau", 200, PLATEAU)
    result = trainer.fit()
    assert result.step == 75 and result.decay_began == 60 and trainer.cfg.max_steps == 75
    assert [point["step"] for point in result.history] == list(range(1, 76))
    lrs = [point["lr"] / 1e-2 for point in result.history]
    assert lrs[59] == pytest.approx(1.0) and lrs[60] < 1.0 and lrs[74] == pytest.approx(0.1)
    assert trainer.checkpoints.latest().step == 75 and trainer.checkpoints.best().step == 75
    planned = plateau_trainer(tmp_path / "planned", 75, [9.0] * 4, decay_patience=None)
    planned.fit()
    assert same_weights(trainer, planned)


def test_a_plateau_waits_for_the_second_epoch_and_patience(tmp_path):
    # Step 60 has no gain within the first epoch: no plateau yet. Step 80's second pass without gain is one.
    waited = plateau_trainer(tmp_path / "waited", 200, [3.0, 2.5, 2.7, 2.8, 2.4])
    assert waited.fit().step == 2 + math.ceil(38 / 0.8)  # back to step 40
    patient = plateau_trainer(tmp_path / "patient", 200, [3.0, 2.0, 1.5, 1.8, 1.7, 1.6, 1.5], decay_patience=2)
    assert patient.fit().step == 75  # 80 and 100 without gain: back to 60
    unset = plateau_trainer(tmp_path / "unset", 100, PLATEAU, decay_patience=None)
    assert unset.fit().step == 100


class Killed(Exception):
    """The process dies here."""


def die():
    raise Killed()


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> Trainer:
    """PLATEAU's run, not interrupted."""
    trainer = plateau_trainer(tmp_path_factory.mktemp("whole"), 200, PLATEAU)
    trainer.fit()
    return trainer


def test_a_run_killed_after_going_back_resumes_on_the_path_it_took(tmp_path, whole):
    killed = plateau_trainer(tmp_path / "killed", 200, PLATEAU)
    train_step = killed.train_step
    killed.train_step = lambda: die() if killed.step == 70 and killed.cfg.max_steps == 75 else train_step()
    with pytest.raises(Killed):
        killed.fit()
    resumed = plateau_trainer(tmp_path / "killed", 200, PLATEAU[4:])
    assert resumed.resume() == 60 and resumed.cfg.max_steps == 75  # the rewound step 60, not step 80
    assert resumed.fit().step == 75 and same_weights(resumed, whole)


def test_a_run_killed_as_it_found_a_plateau_goes_back_when_resumed(tmp_path, whole):
    killed = plateau_trainer(tmp_path / "killed", 200, PLATEAU)
    killed.checkpoints.best = die  # dies as it reads the best checkpoint
    with pytest.raises(Killed):
        killed.fit()
    resumed = plateau_trainer(tmp_path / "killed", 200, PLATEAU[4:])
    assert resumed.resume() == 80
    assert resumed.fit().step == 75 and same_weights(resumed, whole)


def test_a_plateau_under_a_time_budget_is_no_replan_and_a_run_of_the_paced_steps_goes_back_alike(tmp_path):
    """A time budget's plan keeps the steps the run's pace bought, not where a plateau ended it: that follows from
    the run's validation losses, which a run of another learning rate or seed (sharing the plan) does not have. A
    run that takes the paced steps from the start, with these losses (the same configuration), goes back at the
    same step and ends with the same weights."""
    revisions = []
    roomy = Deadline(seconds=600.0, final_seconds=0.0, eval_seconds=0.0, save_seconds=0.0,
                     on_replan=lambda step, max_steps: revisions.append((step, max_steps)))
    paced = plateau_trainer(tmp_path / "paced", 40, PLATEAU + [1.3] * 100, deadline=roomy)
    result = paced.fit()
    assert result.step == 75 and result.decay_began == 60
    assert revisions[0][0] == 10 and revisions[0][1] > 80  # the deadline's room, at its first revision
    assert all(steps > 80 for _, steps in revisions)  # the pace's: none is where the plateau ended the run (75)
    planned = plateau_trainer(tmp_path / "planned", revisions[-1][1], PLATEAU + [1.3] * 100)
    again = planned.fit()
    assert again.step == 75 and again.decay_began == 60 and same_weights(paced, planned)


def test_select_last_keeps_the_final_weights_and_best_picks_the_lowest_val(tmp_path):
    last = make_trainer(tmp_path / "last", 15, select="last")
    fake = iter([2.0, 1.0, 3.0])  # step 10 is best
    last.validate = lambda: next(fake)
    last.fit()
    assert last.select_weights() == 15
    final = last.checkpoints.latest().load_weights()
    assert all(torch.equal(w, last.model.state_dict()[n]) for n, w in final.items())

    best = make_trainer(tmp_path / "best", 15, select="best")
    fake = iter([2.0, 1.0, 3.0])
    best.validate = lambda: next(fake)
    best.fit()
    last_step = {n: w.clone() for n, w in best.model.state_dict().items()}
    assert best.select_weights() == 10
    assert not all(torch.equal(w, last_step[n]) for n, w in best.model.state_dict().items())  # fit kept step 15's
    chosen = best.checkpoints.best()
    assert chosen.step == 10
    assert all(torch.equal(w, best.model.state_dict()[n]) for n, w in chosen.load_weights().items())


def test_a_kill_while_best_is_replaced_keeps_the_previous_best(tmp_path, monkeypatch):
    """best/ is replaced by renames only: the previous best is renamed aside, the new one put in place, then the
    old one removed. A kill between the two renames leaves the previous best, which best() puts back."""
    from ultrathink.train import checkpoint as checkpoint_module

    trainer = make_trainer(tmp_path, 15, select="best")
    fake = iter([2.0, 1.0, 3.0])  # step 5 is best, then step 10 replaces it
    trainer.validate = lambda: next(fake)
    real_replace = checkpoint_module.os.replace

    def killed_at_the_second_best(src, dst):
        if Path(dst).name == "best" and Path(src).name.endswith(".partial") and trainer.step == 10:
            raise KeyboardInterrupt  # the process dies after the old best was renamed aside
        return real_replace(src, dst)

    monkeypatch.setattr(checkpoint_module.os, "replace", killed_at_the_second_best)
    with pytest.raises(KeyboardInterrupt):
        trainer.fit()
    monkeypatch.setattr(checkpoint_module.os, "replace", real_replace)
    assert not (trainer.checkpoints.directory / "best").exists()
    restored = trainer.checkpoints.best()
    assert restored is not None and restored.step == 5
    assert (trainer.checkpoints.directory / "best").is_dir()
    # Killed a moment later, after the new best was in place: the old one is left over, and the next save clears it.
    (trainer.checkpoints.directory / ".best.replaced").mkdir()
    trainer.save_checkpoint()
    assert not (trainer.checkpoints.directory / ".best.replaced").exists()
    assert trainer.checkpoints.best().step == 5


ROUTED = MODEL.model_copy(update={"n_layers": 4, "moe": MODEL.moe.model_copy(update={"enabled": True, "every": 2}),
                                  "dre": MODEL.dre.model_copy(update={"enabled": True, "every": 3, "warmup_steps": 2})})


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_poisoned_batch_in_an_moe_dre_model_is_skipped_and_training_ends_finite(tmp_path, precision):
    """A skipped step must not touch routing state (NaN score quantiles would make the DRE thresholds NaN and every
    later loss NaN) nor leave the fp16 gradient scaler half-way (unscaled but not updated)."""
    trainer = make_trainer(tmp_path, 12, model_cfg=ROUTED, precision=precision, eval_every=100)
    poison(trainer, {4, 5})  # after the DRE warmup: routing is on
    logged = []
    trainer.log_metrics = lambda record, step: logged.append(record)
    result = trainer.fit()
    assert result.step == 12 and result.skipped_steps == 2 and math.isfinite(result.history[-1]["train_loss"])
    assert all(math.isfinite(r["train_loss"]) for r in logged)
    assert all(torch.isfinite(t).all() for t in trainer.model.state_dict().values())
    (routed,) = [m for m in trainer.model.variants.values() if hasattr(m, "thresholds")]
    assert routed.steps.item() == 12  # counted applied steps only
    assert 0.3 < logged[-1]["dre_kept"] < 0.7  # still routing near its capacity, not stuck at 0 or 1
    if precision == "fp16":  # the scaler saw the overflow and halved its scale for each skipped step
        assert trainer.engine.scaler.get_scale() < 2.0**16


@pytest.mark.parametrize("section, line_part, metric", [
    ({"moe": {"enabled": True, "every": 1, "bias_balancing": True}}, "moe=[entropy=", "moe_entropy"),
    ({"dre": {"enabled": True, "every": 2, "warmup_steps": 2}}, "dre=[path=standard,kept=", "dre_kept"),
])
def test_routing_health_reaches_the_tracker_and_the_step_line(tmp_path, capsys, section, line_part, metric):
    logged = []
    routed = MODEL.model_copy(update={k: MODEL.__dict__[k].model_copy(update=v) for k, v in section.items()})
    trainer = make_trainer(tmp_path, 10, model_cfg=routed)
    trainer.log_metrics = lambda record, step: logged.append(record)
    trainer.fit()
    assert len(logged) == 10 and all(metric in record for record in logged)
    assert 0 < logged[-1][metric] <= 1
    captured = capsys.readouterr()
    assert line_part in captured.out + captured.err


def test_gradient_checkpointing_gives_the_same_gradients(tmp_path):
    torch.manual_seed(0)
    model = UltraThink(MODEL.model_copy(update={"dropout": 0.1}), VOCAB).train()
    x, y = next(TokenWindows(corpus(), MODEL.seq_len, 4, seed=0))
    grads = []
    for checkpointed in (False, True):
        model.checkpoint_blocks = checkpointed
        model.zero_grad()
        torch.manual_seed(1)  # same dropout masks; checkpoint replays the RNG state during recomputation
        model(x, y)[1].backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*grads))


NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize(("device", "kernel"), [
    *(("cpu", kernel) for kernel in candidates("auto", "cpu", torch.bfloat16)),
    *(pytest.param("cuda", kernel, marks=NEEDS_CUDA) for kernel in candidates("auto", "cuda", torch.bfloat16))],
    ids=lambda value: label(value) if isinstance(value, AttentionKernel) else value)
def test_the_dense_model_traces_to_one_graph_with_every_attention_kernel(device, kernel):
    """What train.compile fuses is one graph per step: a graph break splits the fusion at every layer. Entering
    autocast through an ExitStack (the fp32 attention kernel's old scope) broke it at each attention call, and the
    compiled step was 0.89x GPT-2's compiled step instead of 1.10x (benchmarks/README.md)."""
    torch.manual_seed(0)
    model = UltraThink(MODEL.model_copy(update={"dropout": 0.0}), 64).to(device)
    model.use_attention(kernel)
    tokens = torch.randint(0, 64, (2, MODEL.seq_len), device=device)

    def loss(idx):
        with torch.autocast(device, dtype=torch.bfloat16):
            return model(idx, idx).loss

    try:
        traced = torch._dynamo.explain(loss)(tokens)
    finally:
        torch._dynamo.reset()  # nothing traced here stays cached for the next test, pass or fail
    assert (traced.graph_count, traced.graph_break_count) == (1, 0), traced.break_reasons


@pytest.mark.spawns
def test_compiled_training_matches_eager(tmp_path):
    """With matmul attention (what `auto` picks for a bf16 CPU's shapes), whose causal softmax a compiled step calls
    as an operator of its own (kernels.causal_softmax): Inductor's step trains the eager step's losses. Torch's
    attention compiled is test_compile_ranks.py's."""
    from torch.profiler import ProfilerActivity, profile

    no_dropout = MODEL.model_copy(update={"dropout": 0.0})  # compiled code draws dropout masks differently
    eager = make_trainer(tmp_path / "eager", 3, model_cfg=no_dropout, eval_every=100, attention="matmul")
    compiled = make_trainer(tmp_path / "compiled", 3, model_cfg=no_dropout, eval_every=100, compile=True,
                            attention="matmul")
    assert compiled.engine.module is not compiled.model  # really an OptimizedModule
    assert compiled.model.attention_kernel() == AttentionKernel("matmul", False)
    losses = [[eager.train_step()[0] for _ in range(3)]]
    try:
        with profile(activities=[ProfilerActivity.CPU]) as traced:
            losses.append([compiled.train_step()[0] for _ in range(3)])
    finally:
        torch._dynamo.reset()
    assert losses[0] == pytest.approx(losses[1], rel=1e-4)
    assert "ultrathink::causal_softmax" in {event.key for event in traced.key_averages()}


def test_a_time_budget_never_replans_past_the_plans_step_ceiling(tmp_path):
    """A deadline with time for far more steps re-plans a run at its first revision (step 10), except past the
    plan's step_ceiling (Deadline.most_steps): there the run ends at its planned steps."""
    class Replanned(Exception):
        """Raised by on_replan: the run revised its steps."""

    def replanned(step, max_steps):
        raise Replanned(max_steps)

    roomy = dict(seconds=600.0, final_seconds=0.0, eval_seconds=0.0, save_seconds=0.0, on_replan=replanned)
    with pytest.raises(Replanned) as grown:
        make_trainer(tmp_path / "open", 20, deadline=Deadline(**roomy)).fit()
    assert grown.value.args[0] > 20
    capped = make_trainer(tmp_path / "capped", 20, deadline=Deadline(**roomy, most_steps=20))
    assert capped.fit().step == 20


@pytest.mark.parametrize("norm", [0.25, 1.0 - 1e-7, 1.0, 1.0 + 1e-7, 4.0, math.nan])
def test_clipping_leaves_the_gradients_bitwise_as_torch_does_and_writes_none_within_the_limit(norm):
    """clip_grad_norm (the engine's) against torch's clip_grad_norm_ on copies of the same gradients, scaled to a
    total norm below, at and just around max_norm 1.0, above it and NaN: the same norm and the same gradient bits.
    Clearly within the limit (0.25) no gradient is written (torch multiplies each by exactly 1); from within fp32's
    rounding of it on, each is, by the coefficient torch computes."""
    torch.manual_seed(0)
    grads = [torch.randn(shape) for shape in ((7, 5), (5,), (3, 4, 2))]
    total = torch.nn.utils.get_total_norm(grads)
    ours, theirs = ([torch.nn.Parameter(torch.zeros_like(g)) for g in grads] for _ in range(2))
    for p, q, g in zip(ours, theirs, grads):
        p.grad, q.grad = g * (norm / total), g * (norm / total)
    versions = [p.grad._version for p in ours]
    expected = torch.nn.utils.clip_grad_norm_(theirs, 1.0).item()
    got = clip_grad_norm(ours, 1.0)
    assert got == expected or (math.isnan(got) and math.isnan(expected))
    for p, q in zip(ours, theirs):
        assert torch.equal(p.grad, q.grad) or (p.grad.isnan().all() and q.grad.isnan().all())
    written = [p.grad._version != v for p, v in zip(ours, versions)]
    assert written == [norm != 0.25] * len(ours)
    never = [torch.nn.Parameter(torch.zeros(3))]
    never[0].grad = torch.full((3,), 1e9)
    assert clip_grad_norm(never, math.inf) == pytest.approx(3 ** 0.5 * 1e9) and never[0].grad._version == 0


def test_a_step_whose_validation_improved_links_its_checkpoint_to_the_best_it_just_wrote(tmp_path, monkeypatch):
    """At a step where the validation improved, the periodic checkpoint is the best one just written: its files
    hard-linked, not written again. Either name replaced later leaves the other whole, and a run resumes from it."""
    from ultrathink.train import checkpoint as checkpoint_module

    trainer = make_trainer(tmp_path, 15, select="best")
    losses = iter([2.0, 3.0, 1.0])  # steps 5 and 15 improve, step 10 does not
    trainer.validate = lambda: next(losses)
    writes = []
    real_commit = checkpoint_module.CheckpointManager._commit
    monkeypatch.setattr(checkpoint_module.CheckpointManager, "_commit",
                        lambda self, tmp, final, step, *rest: writes.append((final.name, step))
                        or real_commit(self, tmp, final, step, *rest))
    trainer.fit()
    assert writes == [("best", 5), ("step_00000010", 10), ("best", 15)]
    directory = trainer.checkpoints.directory
    best, linked, written = directory / "best", directory / "step_00000015", directory / "step_00000010"
    files = sorted(p.relative_to(best) for p in best.rglob("*") if p.is_file())
    assert files and files == sorted(p.relative_to(linked) for p in linked.rglob("*") if p.is_file())
    assert all((best / f).samefile(linked / f) for f in files)
    assert not (best / "state.pt").samefile(written / "state.pt")
    assert trainer.checkpoints.latest().step == 15 and trainer.checkpoints.best().step == 15

    trainer.train_step()  # a new best at step 16 replaces best/: step 15's files are untouched
    trainer.save_checkpoint(name="best")
    assert trainer.checkpoints.best().step == 16
    assert checkpoint_module.read_checkpoint(linked).step == 15
    resumed = make_trainer(tmp_path, 20, seed=99)
    assert resumed.resume() == 15

    # A filesystem that cannot hard-link: the files are copied, and the checkpoint is as good.
    def no_links(source, target):
        raise OSError("hard links not supported")

    monkeypatch.setattr(checkpoint_module.os, "link", no_links)
    copied = trainer.checkpoints.save_as(directory / "best")
    assert copied.name == "step_00000016" and checkpoint_module.read_checkpoint(copied).step == 16
    assert not (copied / "state.pt").samefile(directory / "best" / "state.pt")
