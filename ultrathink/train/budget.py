"""`train.budget`: what a run may spend — wall-clock time, tokens or FLOPs — turned into a number of optimizer steps.

A tokens or FLOPs budget divides exactly. A time budget is turned into steps once, at the start of a configuration's
first run, from a short throughput probe: a few steps of a throwaway model of the same shape (its own optimizer, the
generators restored afterwards, so the real run starts exactly as it would have), plus one validation pass. The
result is a `Plan`, written next to the configuration's checkpoints and logged to MLflow; a resumed run reads it
back instead of measuring again, so resume stays exact, and its `max_steps` reproduces the run as a plain step count.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ultrathink.config import Budget
from ultrathink.io import atomic_write_json

log = logging.getLogger(__name__)

PLAN_FILE = "plan.json"
PROBE_WARMUP_STEPS = 2  # first steps pay kernel selection (and compilation): timed apart
PROBE_STEPS = 5
GUESS_UTILISATION = 0.3  # model.size auto's first guess at the share of the device's matmul peak a step reaches


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


@dataclass
class Plan:
    """What a budget resolved to; everything a resumed or reproduced run needs to take the same steps."""
    budget: str | None
    max_steps: int
    warmup_steps: int
    tokens_per_step: int
    flops_per_token: int
    probe: Probe | None = None
    sizing: dict = field(default_factory=dict)  # model.size: auto's choice and its reasons (sizing.py)
    compile: bool = False  # train.compile, decided (auto) from the budget and the probe

    def save(self, directory: Path) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        atomic_write_json(Path(directory) / PLAN_FILE, self.to_dict())

    @classmethod
    def load(cls, directory: Path) -> "Plan | None":
        path = Path(directory) / PLAN_FILE
        if not path.is_file():
            return None
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, raw: dict) -> "Plan":
        return cls(**{**raw, "probe": Probe(**raw["probe"]) if raw.get("probe") else None})

    def to_dict(self) -> dict:
        return asdict(self)

    def mlflow_params(self) -> dict[str, object]:
        params = {"plan.max_steps": self.max_steps, "plan.warmup_steps": self.warmup_steps,
                  "plan.tokens": self.max_steps * self.tokens_per_step}
        if self.probe:
            params.update({"plan.step_seconds": round(self.probe.step_seconds, 4),
                           "plan.probe_seconds": round(self.probe.seconds, 2)})
        return params


def _timed(fn, device: str) -> float:
    started = time.perf_counter()
    fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def steps_for(budget: Budget, tokens_per_step: int, flops_per_token: int, cfg, measured: Probe | None) -> int:
    """Optimizer steps the budget buys. A time budget pays, out of its seconds, for the probe, the first steps'
    extra cost, and the validation passes and checkpoints (every eval_every / checkpoint_every steps and at the
    end) as measured."""
    if budget.kind == "tokens":
        return max(1, math.ceil(budget.amount / tokens_per_step))
    if budget.kind == "flops":
        return max(1, math.ceil(budget.amount / (flops_per_token * tokens_per_step)))
    assert measured is not None, "a time budget needs a probe"
    left = (budget.amount - measured.seconds - measured.first_steps_extra - measured.eval_seconds
            - measured.save_seconds)
    per_step = (measured.step_seconds + measured.eval_seconds / cfg.eval_every
                + measured.save_seconds / cfg.checkpoint_every)
    return max(1, int(left / per_step))


def warmup_for(max_steps: int, cfg) -> int:
    """train.warmup_fraction of the steps when set (so warmup scales with the budget), else train.warmup_steps,
    never more than the steps."""
    if cfg.warmup_fraction is not None:
        return min(max_steps, max(1, round(cfg.warmup_fraction * max_steps)))
    return min(max_steps, cfg.warmup_steps)


def probe_shape(model_cfg, train_cfg, vocab_size: int, train_tokens, val_tokens, device: str) -> Probe:
    """Time PROBE_STEPS optimizer steps (after PROBE_WARMUP_STEPS), one validation pass and one checkpoint of a
    throwaway model of `model_cfg`'s shape, trained in one process on `device` with the run's settings (eager when
    train.compile is auto: that is decided from this). The global generators are restored afterwards; nothing of
    the real run is touched."""
    from ultrathink.model import UltraThink
    from ultrathink.train.checkpoint import CheckpointManager, Fingerprint
    from ultrathink.train.distributed import Distributed
    from ultrathink.train.loader import TokenWindows
    from ultrathink.train.trainer import Trainer

    started = time.perf_counter()
    devices = [torch.device(device).index or 0] if device.startswith("cuda") else []
    with torch.random.fork_rng(devices=devices), tempfile.TemporaryDirectory(prefix="ultrathink-probe-") as tmp:
        torch.manual_seed(train_cfg.seed)
        cfg = train_cfg.model_copy(update={"max_steps": 10**9, "warmup_steps": 1,
                                           "compile": train_cfg.compile is True})
        trainer = Trainer(UltraThink(model_cfg, vocab_size),
                          TokenWindows(train_tokens, model_cfg.seq_len, cfg.batch_size, cfg.seed), val_tokens, cfg,
                          CheckpointManager(tmp, Fingerprint("probe", "probe", "probe"), keep=1, keep_configs=1),
                          dist=Distributed(device=device))
        first = [_timed(trainer.train_step, device) for _ in range(PROBE_WARMUP_STEPS)]
        steps = [_timed(trainer.train_step, device) for _ in range(PROBE_STEPS)]
        eval_seconds = _timed(trainer.validate, device)
        save_seconds = _timed(trainer._save, device)
    step = statistics.median(steps)
    return Probe(step, max(0.0, sum(first) - PROBE_WARMUP_STEPS * step), eval_seconds, save_seconds,
                 time.perf_counter() - started)


def make_plan(model_cfg, train_cfg, vocab_size: int, train_tokens, val_tokens, device: str,
              world_size: int = 1) -> tuple[Plan, object, object]:
    """(plan, resolved model config, resolved train config) for this run: the budget turned into steps, and under
    model.size auto the shape and batch sizing.py chooses for it. Without a budget the plan is train.max_steps."""
    from ultrathink.train import sizing
    from ultrathink.train.precision import peak_flops

    sized, probes = None, []
    if model_cfg.size == "auto":
        budget = Budget.parse(train_cfg.budget)
        corpus = len(train_tokens)
        if budget.kind == "seconds":
            # First guess from the device's matmul peak at a typical small-model utilisation, then once more from
            # the throughput measured on that guess (smaller models use a device less well).
            rate = (peak_flops(train_cfg.precision, device) or 1e11) * GUESS_UTILISATION * world_size
            for _ in range(2):
                sized = sizing.choose(model_cfg, vocab_size, corpus, flops=rate * budget.amount,
                                      batch_size=train_cfg.batch_size)
                shaped = _sized(model_cfg, train_cfg, sized)
                if probes and probes[-1][0] == (shaped[0], shaped[1].batch_size):
                    break
                probes.append(((shaped[0], shaped[1].batch_size),
                               probe_shape(*shaped, vocab_size, train_tokens, val_tokens, device)))
                tokens_per_step = shaped[1].batch_size * shaped[1].grad_accum * shaped[0].seq_len * world_size
                rate = sized.flops_per_token * tokens_per_step / probes[-1][1].step_seconds
        else:
            sized = sizing.choose(model_cfg, vocab_size, corpus, batch_size=train_cfg.batch_size,
                                  **{"flops" if budget.kind == "flops" else "tokens": budget.amount})
        model_cfg, train_cfg = _sized(model_cfg, train_cfg, sized)
    tokens_per_step = train_cfg.batch_size * train_cfg.grad_accum * model_cfg.seq_len * world_size
    flops_per_token = sizing.counts(sizing.Shape(*(getattr(model_cfg, k) for k in sizing.SHAPE_KEYS)),
                                    model_cfg, vocab_size)[2]
    measured = None
    if train_cfg.budget is not None:
        budget = Budget.parse(train_cfg.budget)
        if budget.kind == "seconds" or train_cfg.compile == "auto":
            if not probes:
                probes.append((None, probe_shape(model_cfg, train_cfg, vocab_size, train_tokens, val_tokens, device)))
            last = probes[-1][1]
            measured = Probe(last.step_seconds, last.first_steps_extra, last.eval_seconds, last.save_seconds,
                             sum(p.seconds for _, p in probes))
        max_steps = steps_for(budget, tokens_per_step, flops_per_token, train_cfg, measured)
    else:
        max_steps = train_cfg.max_steps
    warmup = warmup_for(max_steps, train_cfg)
    compile = compile_pays(train_cfg, model_cfg, max_steps, measured)
    train_cfg = train_cfg.model_copy(update={"max_steps": max_steps, "warmup_steps": warmup, "compile": compile})
    plan = Plan(train_cfg.budget, max_steps, warmup, tokens_per_step, flops_per_token, measured,
                sized.to_dict() if sized else {}, compile)
    return plan, model_cfg, train_cfg


# train.compile auto compiles a run whose eager training is measured to take at least this long: torch.compile
# costs 20-40 s on a CPU for these models (benchmarks/train_throughput.py) and made the step 1.6× faster there.
COMPILE_PAYS_AFTER_SECONDS = 600


def compile_pays(train_cfg, model_cfg, max_steps: int, measured: Probe | None) -> bool:
    """train.compile: true and false are kept; auto compiles a dense model (routing variants change shapes every
    step, which would recompile) whose measured eager run is long enough for the compile cost not to matter."""
    if train_cfg.compile != "auto":
        return train_cfg.compile
    return (measured is not None and not model_cfg.variants() and train_cfg.backend != "deepspeed"
            and max_steps * measured.step_seconds >= COMPILE_PAYS_AFTER_SECONDS)


def _sized(model_cfg, train_cfg, sized):
    return (model_cfg.model_copy(update={**asdict(sized.shape), "size": "manual"}),
            train_cfg.model_copy(update={"batch_size": sized.batch_size}))


def apply_plan(plan: Plan, model_cfg, train_cfg):
    """The model and train configs a recorded plan resolved (a resumed run: no probe, the same steps)."""
    if plan.sizing:
        from ultrathink.train.sizing import Sizing

        model_cfg, train_cfg = _sized(model_cfg, train_cfg, Sizing.from_dict(plan.sizing))
    return model_cfg, train_cfg.model_copy(update={"max_steps": plan.max_steps, "warmup_steps": plan.warmup_steps,
                                                   "compile": plan.compile})
