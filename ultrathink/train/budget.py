"""`train.budget`: what a run may spend — wall-clock time, tokens or FLOPs — turned into a number of optimizer steps.

A tokens or FLOPs budget divides exactly. A time budget is turned into steps once per configuration and machine
class, from a short throughput probe: a few steps of a throwaway model of the same shape (its own optimizer, the
generators restored afterwards, so the real run starts exactly as it would have), one validation pass and one
checkpoint. The run that measured revises its steps while it trains, from its real step time (trainer.py,
`Deadline`); the steps it took are recorded in the plan (plan.py), which later runs reuse instead of measuring.
"""

from __future__ import annotations

import contextlib
import logging
import math
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ultrathink.config import Budget
from ultrathink.device import device_type, is_cuda, synchronize
from ultrathink.model import UltraThink
from ultrathink.train.checkpoint import CheckpointManager, Fingerprint
from ultrathink.train.distributed import Distributed
from ultrathink.train.engine import build_engine, cannot_compile
from ultrathink.train.loader import TokenWindows
from ultrathink.train.trainer import Trainer, ready_model

log = logging.getLogger(__name__)

PROBE_WARMUP_STEPS = 2  # first steps pay kernel selection (and compilation): timed apart
PROBE_STEPS = 5


@dataclass
class Probe:
    """Measured on a throwaway model of the run's shape: seconds per optimizer step (median of PROBE_STEPS), the extra
    seconds of the first steps (kernel selection, compilation), one validation pass, one checkpoint written (to a
    temporary folder), and the probe's own time."""
    step_seconds: float
    first_steps_extra: float
    eval_seconds: float
    save_seconds: float
    seconds: float
    ranks: int = 1  # the processes that probed together (a run's collectives included)

    @property
    def validation_seconds(self) -> float:
        """A validation pass and the best checkpoint it writes when the loss improved, as it mostly does under a
        budget (trainer.fit times the two together). Counting the pass alone planned an H200's 2-minute run at 279
        steps of a 434M model that had time for 194: its checkpoints were 5 GB."""
        return self.eval_seconds + self.save_seconds


def _timed(fn, device: str) -> float:
    started = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - started


def steps_for(budget: Budget, tokens_per_step: int, flops_per_token: int, cfg, measured: Probe | None) -> int:
    """Optimizer steps the budget buys. A time budget pays, out of its seconds, for the probe, the first steps'
    extra cost, and the validation passes (each with its best checkpoint: every eval_every steps and at the end)
    and the checkpoints written apart from them, as measured."""
    if budget.kind == "tokens":
        return max(1, math.ceil(budget.amount / tokens_per_step))
    if budget.kind == "flops":
        return max(1, math.ceil(budget.amount / (flops_per_token * tokens_per_step)))
    assert measured is not None, "a time budget needs a probe"
    left = budget.amount - measured.seconds - measured.first_steps_extra - measured.validation_seconds
    per_step = (measured.step_seconds + measured.validation_seconds / cfg.eval_every
                + measured.save_seconds * checkpoints_apart(cfg) / cfg.checkpoint_every)
    return max(1, int(left / per_step))


def checkpoints_apart(cfg) -> float:
    """The share of the periodic checkpoints (every checkpoint_every steps) that fall on no validation step. One
    that does links the best checkpoint that step's validation wrote (a validation that improved writes one, as
    under a budget it mostly does: Trainer.fit) and costs nothing; so does the last step's."""
    return 1 - cfg.checkpoint_every / math.lcm(cfg.checkpoint_every, cfg.eval_every)


def training_seconds(budget: Budget, cfg, probe: Probe, spent: float) -> float:
    """The seconds of training steps a time budget leaves at a probed shape once `spent` seconds of probing, the first
    steps' extra cost, and the validation passes and checkpoints at that shape's measured cost are paid: what model
    size auto compares shapes at. On a GPU these overheads were most of a small budget (an H200, 12 s on tiny
    Shakespeare: 5 s trained; 2 min: 66 s), and a larger shape pays more of them."""
    return steps_for(budget, 1, 1, cfg, replace(probe, seconds=spent)) * probe.step_seconds


def warmup_for(max_steps: int, cfg) -> int:
    """train.warmup_fraction of the steps when set (so warmup scales with the budget), else train.warmup_steps,
    never more than the steps."""
    if cfg.warmup_fraction is not None:
        return min(max_steps, max(1, round(cfg.warmup_fraction * max_steps)))
    return min(max_steps, cfg.warmup_steps)


def probe_shape(model_cfg, train_cfg, vocab_size: int, train_tokens, val_tokens, device: str,
                attention=None, dist: Distributed | None = None) -> Probe:
    """Time PROBE_STEPS optimizer steps (after PROBE_WARMUP_STEPS), one validation pass and one checkpoint of a
    throwaway model of `model_cfg`'s shape, trained with the run's settings (eager when train.compile is auto: that
    is decided from this) in one process on `device`, or on all of `dist`'s ranks — each calls this with the same
    arguments, so the steps and the checkpoint pay the run's collectives. The global generators are restored
    afterwards; nothing of the real run is touched."""
    started = time.perf_counter()
    dist = dist or Distributed(device=device)
    with _throwaway(device), _shared_temp_dir(dist) as tmp:
        trainer = _throwaway_trainer(model_cfg, train_cfg, vocab_size, train_tokens, val_tokens, attention, dist, tmp)
        first = [_timed(trainer.train_step, device) for _ in range(PROBE_WARMUP_STEPS)]
        steps = [_timed(trainer.train_step, device) for _ in range(PROBE_STEPS)]
        eval_seconds = _timed(trainer.validate, device)
        save_seconds = _timed(trainer.save_checkpoint, device)
    step = statistics.median(steps)
    return Probe(step, max(0.0, sum(first) - PROBE_WARMUP_STEPS * step), eval_seconds, save_seconds,
                 time.perf_counter() - started, dist.world_size)


def step_seconds_side_by_side(configs: list[tuple], vocab_size: int, train_tokens, val_tokens, device: str,
                              dist: Distributed | None = None) -> tuple[list[float], float]:
    """The step seconds of several (model config, train config, attention kernel) measured side by side: a
    throwaway of each, as probe_shape builds it, one step each to warm up, then PROBE_STEPS rounds of one step of
    each in turn; each one's median, and the seconds it all took. Probed one after another, two shapes are timed
    at different moments of a shared machine: on 2 busy cores of an AMD EPYC, five steps' medians of one shape
    read 71-110 ms within 40 s, while the ratio of two shapes' medians, stepped in turn, read 1.31-1.68 around
    1.46 (benchmarks/README.md). On every rank of `dist` alike, as probe_shape."""
    started = time.perf_counter()
    dist = dist or Distributed(device=device)
    with _throwaway(device), _shared_temp_dir(dist) as tmp:
        trainers = [_throwaway_trainer(model_cfg, train_cfg, vocab_size, train_tokens, val_tokens, attention, dist,
                                       tmp / str(i)) for i, (model_cfg, train_cfg, attention) in enumerate(configs)]
        for trainer in trainers:
            trainer.train_step()
        rounds = [[_timed(trainer.train_step, device) for trainer in trainers] for _ in range(PROBE_STEPS)]
    return [statistics.median(steps) for steps in zip(*rounds)], time.perf_counter() - started


@contextlib.contextmanager
def _throwaway(device: str):
    """The global generators as they were before (a probe's model and loader draw from them)."""
    devices = [torch.device(device).index or 0] if is_cuda(device) else []
    with torch.random.fork_rng(devices=devices):
        yield


def _throwaway_trainer(model_cfg, train_cfg, vocab_size: int, train_tokens, val_tokens, attention,
                       dist: Distributed, folder: Path) -> Trainer:
    """A Trainer of a fresh model of `model_cfg`'s shape with the run's settings, seeded as the run is, stepping
    without end (no schedule's end to reach), eager unless train.compile is true, checkpointing into `folder`."""
    torch.manual_seed(train_cfg.seed)
    cfg = train_cfg.model_copy(update={"max_steps": 10**9, "warmup_steps": 1, "compile": train_cfg.compile is True})
    engine = build_engine(ready_model(UltraThink(model_cfg, vocab_size), cfg, attention, dist), cfg, dist)
    loader = TokenWindows(train_tokens, model_cfg.seq_len, cfg.batch_size, cfg.seed, rank=dist.rank,
                          world_size=dist.world_size, grad_accum=cfg.grad_accum)
    return Trainer(engine, loader, val_tokens, cfg,
                   CheckpointManager(folder, Fingerprint("probe", "probe", "probe"), keep=1, keep_configs=1),
                   dist=dist)


@contextlib.contextmanager
def _shared_temp_dir(dist: Distributed):
    """A temporary folder that every rank of `dist` writes its checkpoint shards into; removed when all are done."""
    path = Path(tempfile.mkdtemp(prefix="ultrathink-probe-")) if dist.is_main else None
    path = Path(dist.share(str(path) if path else None))
    try:
        yield path
    finally:
        dist.barrier()
        if dist.is_main:
            shutil.rmtree(path, ignore_errors=True)


# train.compile auto compiles a run whose eager training is measured to take at least this long, by device type
# (benchmarks/README.md). A CPU: torch.compile costs 34-40 s on 2 cores for these models with an empty inductor
# cache and makes the step 1.1-1.45× faster, least at the larger shapes long budgets pick: it pays after ~110-440 s.
# With Inductor's C++ wrapper (engine.COMPILE_OPTIONS) the compile took 10-20 s longer for a step ~4.5% faster
# still (measured at d384 × 6): up to ~65 s for 1.15-1.5×, paying after ~130-500 s.
# A GPU (an H200, its host's 16 cores compiling): 14-38 s, and the step 1.6-1.9× faster: it pays after ~40-80 s;
# 120 s is 1.5× the slowest. Any other device type goes by the CPU's.
COMPILE_PAYS_AFTER_SECONDS = {"cpu": 600, "cuda": 120}


def compile_pays(train_cfg, model_cfg, max_steps: int, measured: Probe | None, device: str) -> bool:
    """train.compile: true and false are kept; auto compiles a dense model (routing variants change shapes every
    step, which would recompile) whose measured eager run on `device` is long enough for the compile to pay, where
    a compiled step can be built (engine.cannot_compile; else it says why it stays eager)."""
    if train_cfg.compile != "auto":
        return train_cfg.compile
    pays_after = COMPILE_PAYS_AFTER_SECONDS.get(device_type(device), COMPILE_PAYS_AFTER_SECONDS["cpu"])
    pays = (measured is not None and not model_cfg.variants() and train_cfg.backend != "deepspeed"
            and max_steps * measured.step_seconds >= pays_after)
    missing = cannot_compile(device) if pays else None
    if missing:
        log.warning("train.compile auto: compiling would pay (%.0f s of eager steps), but %s: training eagerly",
                    max_steps * measured.step_seconds, missing)
    return pays and not missing
