"""The training loop. It takes a model, data, a TrainConfig, a checkpoint manager and a metrics callback; it knows
nothing of DVC, Prefect or MLflow."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Protocol

import numpy as np
import torch
from tqdm import tqdm

from ultrathink import scoring
from ultrathink.model import routing
from ultrathink.config import TrainConfig
from ultrathink.device import is_cuda
from ultrathink.errors import StageError
from ultrathink.train.averaging import WeightAverage, ema_horizon_for
from ultrathink.train.checkpoint import Checkpoint, CheckpointManager
from ultrathink.train.distributed import Distributed
from ultrathink.train.engine import Engine, autocast
from ultrathink.train.loader import BatchLayout, ContextWarmup, TokenStreamEval, TokenWindows
from ultrathink.model.kernels import AttentionKernel, fixed_kernel
from ultrathink.train.precision import peak_flops
from ultrathink.train.schedule import Scheduler, decay_from, lr_factor, same_schedule

log = logging.getLogger(__name__)

MetricsSink = Callable[[dict[str, float], int], None]


class EvalData(Protocol):
    def eval_batches(self, batch_size: int, max_batches: int | None = None) -> Iterable[tuple[torch.Tensor, torch.Tensor]]: ...


class Objective(Protocol):
    """What a step minimises over one micro-batch of the loader's, and what validation measures. The default is
    next-token prediction; alignment plugs in its preference loss (ultrathink.align.dpo)."""

    def weight(self, batch) -> int:
        """What the batch's loss is a mean over (its targets, its pairs): a step weighs micro-batches by it."""

    def loss(self, module: torch.nn.Module, batch, device) -> tuple[torch.Tensor, dict]:
        """(the micro-batch's mean loss, the routing variants' statistics of its forward)."""

    def validate(self, model: torch.nn.Module, val_data, cfg: TrainConfig) -> float:
        """The held-out loss that early stopping and train.select go by (lower is better)."""


class NextToken:
    """Next-token cross-entropy on the targets that are not IGNORE (pretraining, fine-tuning's answers)."""

    def weight(self, batch) -> int:
        return int((batch[1] != scoring.IGNORE).sum())

    def loss(self, module, batch, device) -> tuple[torch.Tensor, dict]:
        x, y = (t.to(device, non_blocking=True) for t in batch)
        out = module(x, y)
        return out.loss, out.routing

    def validate(self, model, val_data, cfg: TrainConfig) -> float:
        return mean_loss(model, val_data.eval_batches(cfg.batch_size, cfg.eval_batches), cfg.precision)[0]


class NonFiniteLossError(StageError):
    """Training produced too many non-finite losses or gradients in a row; no checkpoint was written from them."""


def mean_loss(model, batches, precision: str) -> tuple[float, int]:
    """Mean next-token loss over `batches` and the number of predicted tokens, in `precision`."""
    device = str(next(model.parameters()).device)
    return scoring.mean_loss(model, ((x.to(device), y.to(device)) for x, y in batches),
                             lambda: autocast(precision, device))


@dataclass
class TrainResult:
    step: int
    resumed_from: int | None
    history: list[dict[str, float]] = field(default_factory=list)
    seconds: float = 0.0
    tokens_per_second: float = 0.0
    skipped_steps: int = 0
    best_val_loss: float | None = None
    stopped_early: bool = False
    decay_began: int | None = None  # where train.decay_patience began the decay, after a plateau


@dataclass
class Deadline:
    """A time budget's end, given to the run that measured its plan: while it trains, fit() re-plans max_steps
    from the real step time (a probe's few steps can be off by 2×, and a machine's speed drifts), only where the
    schedule of the steps already taken stays what it was — during warmup, and for WSD until its decay begins — so
    a later run that takes the final step count from the start computes the same steps. `on_replan(step,
    max_steps)` records each revision."""
    seconds: float  # what fit() may spend: the budget less the probe that planned it
    final_seconds: float  # what follows the last step: selecting the best weights, saving the model
    eval_seconds: float  # one validation pass with its best checkpoint: as probed, then as observed
    save_seconds: float  # one periodic checkpoint (none where it links that best: budget.checkpoints_apart): likewise
    on_replan: Callable[[int, int], None] = lambda step, max_steps: None
    most_steps: int | None = None  # never re-planned past these (the plan's step_ceiling)


@dataclass
class Counters:
    """The guard's and early stopping's counts: part of a checkpoint's state, so a resumed run makes the same
    decisions (an early-stopped run stays stopped)."""
    skipped: int = 0  # steps skipped for a non-finite loss or gradient
    bad_in_a_row: int = 0
    evals_without_gain: int = 0
    best_val: float = math.inf
    best_step: int | None = None
    stopped_early: bool = False
    decay_began: int | None = None  # the step train.decay_patience rewound to and began the WSD decay from


def ready_model(model: torch.nn.Module, cfg: TrainConfig, attention: AttentionKernel | None,
                dist: Distributed) -> torch.nn.Module:
    """Make `model` ready for a Trainer, in the open: on the run's device, with the attention kernel the plan chose
    (default: the one train.attention names) and train.gradient_checkpointing; then seed this rank's generator
    (the model was initialised identically on every rank; from here each rank draws its own dropout masks)."""
    model.to(dist.device)
    model.checkpoint_blocks = cfg.gradient_checkpointing
    model.use_attention(attention or fixed_kernel(cfg.attention))
    torch.manual_seed(cfg.seed + dist.rank)
    return model


REPLAN_FIRST = 10  # steps before the first revision: the first steps pay kernel set-up


class Trainer:
    def __init__(self, engine: Engine, train_loader: TokenWindows, val_data: np.ndarray | EvalData,
                 cfg: TrainConfig, checkpoints: CheckpointManager,
                 log_metrics: MetricsSink | None = None, dist: Distributed | None = None,
                 peak_flops: float | None = None, deadline: Deadline | None = None,
                 objective: Objective | None = None, context: ContextWarmup | None = None):
        """`train_loader` gives batches of the objective's (next-token's: (x, y), targets -100 not trained on) and
        has `seq_len` (tokens per row of its batches), `layout` and a state_dict; `val_data` is the val split's
        tokens or anything with `eval_batches(batch_size, max_batches)` that gives the objective's batches.
        `peak_flops`: the device's FLOP/s in this precision, for MFU (default: precision.peak_flops).
        `deadline`: a time budget's end, when this run measured the plan. `context`: the plan's short contexts
        first (pretraining's token windows only: a cut chat would lose its prompt).

        `engine` takes the steps: build it with build_engine(ready_model(model, ...), cfg, dist). The trainer does
        not move the model, seed the random generators, change the model's settings or wrap it behind the caller's
        back: ready_model and build_engine do those, in the open."""
        self.dist = dist or Distributed()
        # `engine.module` runs the forward pass (the model or its DDP/FSDP/DeepSpeed wrapper); `model`, the same
        # parameters unwrapped, is what is evaluated and saved.
        self.engine, model = engine, engine.model
        self.model, self.loader, self.cfg = model, train_loader, cfg
        self.deadline, self.peak_flops, self.context = deadline, peak_flops, context
        self.objective = objective or NextToken()
        self.val_data = val_data if hasattr(val_data, "eval_batches") else TokenStreamEval(val_data, train_loader.seq_len)
        self.checkpoints = checkpoints
        self.log_metrics = log_metrics or (lambda metrics, step: None)
        if model.checkpoint_blocks != cfg.gradient_checkpointing:
            raise ValueError(f"the model's gradient checkpointing is {model.checkpoint_blocks}, "
                             f"train.gradient_checkpointing is {cfg.gradient_checkpointing}: set it first "
                             "(trainer.ready_model)")
        self.flops_per_token = engine.flops_per_token
        self.scheduler = Scheduler(self.engine.optimizers, cfg)
        self.step = 0
        self.history: list[dict[str, float]] = []
        self.counters = Counters()
        self.layout = train_loader.layout  # the global batch, and this rank's micro-batches of it
        wanted = BatchLayout.split(cfg.batch_size, cfg.grad_accum, self.dist.world_size).accum
        if self.layout.accum != wanted:  # the engine divides each micro-batch's loss by `wanted`
            raise ValueError(f"the loader reads {self.layout.accum} micro-batches per step and train.grad_accum "
                             f"{cfg.grad_accum} on {self.dist.world_size} ranks means {wanted}: build it with "
                             "grad_accum=cfg.grad_accum, rank and world_size")
        self.tokens_per_step = self.layout.sequences * train_loader.seq_len
        horizon = ema_horizon_for(cfg.ema_horizon, self.dist.backend)
        self.average = WeightAverage(model, horizon) if horizon else None

    # ---- checkpoint state -------------------------------------------------------------------------------------
    def state(self) -> dict:
        return {
            "step": self.step,
            "engine": self.engine.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "loader": self.loader.state_dict(),
            "rng": self.dist.gather_rng_states(),  # every rank's CPU and CUDA generators (collective)
            "history": self.history,
            "counters": asdict(self.counters),
            "attention": self.model.attention_kernel().to_dict(),  # a resumed run computes with the same kernel
            "average": self.average.state_dict() if self.average else None,
        }

    def resume(self) -> int | None:
        """Continue from the latest intact checkpoint of this configuration; otherwise start fresh. Checkpoints
        of other configurations are never resumed and never deleted here."""
        return self.resume_from(self.checkpoints.latest() if self.cfg.resume else None)

    def resume_from(self, latest: Checkpoint | None) -> int | None:
        """resume() where the caller has looked up `latest` already (this configuration's newest intact
        checkpoint where train.resume is on; its files are verified by the lookup, once)."""
        if not self.cfg.resume:
            aside = self.checkpoints.set_aside() if self.dist.is_main else None
            self.dist.barrier()
            if aside:
                log.warning("train.resume is false: starting over; this configuration's earlier checkpoints are "
                            "kept in %s", aside)
            return None
        if latest is None:
            self._explain_fresh_start()
            return None
        self._restore(latest)
        log.warning("resumed from %s at step %d", latest.path, self.step)
        return self.step

    def _restore(self, checkpoint) -> None:
        """Take up the run where `checkpoint` left it: weights, optimizer, schedule, data position, generators."""
        state = checkpoint.load_state()
        self.engine.load(checkpoint, state["engine"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.loader.load_state_dict(state["loader"])
        self.step, self.history = state["step"], state["history"]
        if not self.dist.restore_rng_states(state["rng"], self.cfg.seed, self.step):
            log.warning("%s was written by %d ranks, this run has %d: random generators are seeded afresh per "
                        "rank (dropout masks differ from an uninterrupted run)", checkpoint.path, len(state["rng"]),
                        self.dist.world_size)
        self.counters = Counters(**state["counters"])
        if self.counters.decay_began is not None:
            self._revise_steps(decay_from(self.counters.decay_began, self.cfg))
        if "attention" in state:
            self.model.use_attention(AttentionKernel(**state["attention"]))
        if self.average is not None:
            self.average.load_state_dict(state.get("average"))

    def _explain_fresh_start(self) -> None:
        """One line on why the newest checkpoint on disk is not resumed (another configuration's)."""
        others = self.checkpoints.others()
        if not others:
            return
        newest = others[0]
        differs = self.checkpoints.fingerprint.differences(newest.parts) or ["settings"]
        log.warning("not resuming from %s: made with other %s than this run (configuration %s); it is kept "
                    "(train.keep_configs=%d); starting fresh", newest.path, " and ".join(differs),
                    self.checkpoints.fingerprint.id, self.cfg.keep_configs)

    def load_optimizer_from(self, checkpoint) -> None:
        """Warm start: take a checkpoint's optimizer state (the schedule stays this run's). TorchEngine only: the
        schema refuses train.init_optimizer with DeepSpeed, whose optimizer state is sharded per rank."""
        self.engine.load_optimizer(checkpoint, checkpoint.load_state()["engine"])

    # ---- the loop -------------------------------------------------------------------------------------------
    def train_step(self) -> tuple[float, float, dict[str, float]] | None:
        """One optimizer step over this rank's micro-batches of the global batch: (mean loss, gradient norm before clipping, routing
        figures), or None when the loss or gradient is not finite — then the update is skipped and counted.

        Routing variants (MoE, DRE) report statistics with each forward; they are summed over micro-batches and
        ranks here, in one collective, identically for every backend. Only an applied step moves the routing
        state, on every rank from the same numbers; a skipped step's statistics are dropped with it."""
        self.engine.module.train()
        batches = [next(self.loader) for _ in range(self.layout.accum)]
        if self.context is not None:
            batches = [self.context.cut(batch, self.step) for batch in batches]
        # The step's loss is the mean over the global batch's targets, however the ranks and micro-batches split
        # it: a micro-batch's mean loss weighs by its share of the targets (fine-tuning's answers differ in length;
        # in pretraining every share is equal and every weight exactly 1).
        targets = [self.objective.weight(batch) for batch in batches]
        in_step = max(self.dist.sum(float(sum(targets))), 1.0)
        total, stats = 0.0, {}
        for batch, count in zip(batches, targets):
            with self.engine.autocast():
                loss, routed = self.objective.loss(self.engine.module, batch, self.dist.device)
            weight = count * self.layout.accum * self.dist.world_size / in_step  # the engine and ranks average
            self.engine.backward(loss if weight == 1.0 else loss * weight)
            total += loss.item() * count / in_step
            stats = routing.add(stats, routed)
        total = self.dist.sum(total)  # every rank sees the same loss, so all take the same skip decision
        stats = self.dist.sum_stats(stats)
        grad_norm, applied = self.engine.step(total)
        if not applied:
            self._count_bad_step(total, grad_norm)
            return None
        self.counters.bad_in_a_row = 0
        self.scheduler.step()
        self.model.update_routing(stats)
        if self.average is not None:
            self.average.update(self.step, self.cfg)
        self.step += 1
        return total, grad_norm, self.model.routing_metrics(stats)

    def _count_bad_step(self, loss: float, grad_norm: float) -> None:
        self.counters.skipped += 1
        self.counters.bad_in_a_row += 1
        log.warning("step %d: non-finite loss %s or gradient norm %s; update skipped (%d in a row)",
                    self.step + 1, loss, grad_norm, self.counters.bad_in_a_row)
        if self.counters.bad_in_a_row >= self.cfg.max_bad_steps:
            raise NonFiniteLossError(
                f"{self.counters.bad_in_a_row} consecutive steps with a non-finite loss or gradient at step "
                f"{self.step + 1} (train.max_bad_steps={self.cfg.max_bad_steps}); lower train.lr or check the data. "
                f"The last good checkpoint is kept in {self.checkpoints.directory}")

    def save_checkpoint(self, name: str | None = None) -> Path:
        """Every rank takes part (gathering weights, writing its shards); the main process writes the rest."""
        self.engine.check_replicas()
        self.dist.check_routing_state(self.model)
        from_shards = self.engine.writes_weights  # FSDP: nobody gathers the weights for a checkpoint
        weights, state = None if from_shards else self.full_weights(), self.state()
        return self.checkpoints.save(self.step, self.model, state, name=name, weights=weights,
                                     shards=self.engine.save_shards, dist=self.dist, weights_in_shards=from_shards)

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The whole model's weights (gathered from all ranks under FSDP and ZeRO-3; collective there)."""
        return self.engine.model_state()

    def validate(self) -> float:
        return self.objective.validate(self.model, self.val_data, self.cfg)

    def _count_validation(self, val_loss: float) -> bool:
        """Count a validation pass toward early stopping; True when it is the best so far."""
        if val_loss < self.counters.best_val:
            self.counters.best_val, self.counters.best_step, self.counters.evals_without_gain = val_loss, self.step, 0
            return True
        self.counters.evals_without_gain += 1
        patience = self.cfg.early_stopping_patience
        self.counters.stopped_early = patience is not None and self.counters.evals_without_gain >= patience
        return False

    def fit(self) -> TrainResult:
        """Train up to cfg.max_steps from the current step (call resume() first to continue a checkpoint). The
        model then holds the last step's weights; select_weights() applies train.select."""
        first_step, stop = self.step, bool(self.counters.stopped_early)
        started, window_start, window_steps, trained = time.perf_counter(), time.perf_counter(), 0, 0
        bar = tqdm(total=self.cfg.max_steps, initial=self.step, desc="train", unit="step",
                   disable=None if self.dist.is_main else True, leave=False)
        peak = self.peak_flops or peak_flops(self.cfg.precision, self.dist.device)  # None: MFU is left out
        if peak and self.dist.is_main:
            log.info("mfu: model FLOPs per second over %s of %.0f GFLOP/s per rank (%s)",
                     "the datasheet peak" if is_cuda(self.dist.device) else "the measured matmul peak", peak / 1e9,
                     self.cfg.precision)
        pace = Pace(started)
        if not stop and self._plateaued():  # resumed from the checkpoint written where a plateau was found
            self._decay_from_best()
            self._show(bar)
        while self.step < self.cfg.max_steps and not stop:
            outcome = self.train_step()
            if outcome is None:
                continue
            cfg = self.cfg
            loss, grad_norm, routing_figures = outcome
            window_steps, trained = window_steps + 1, trained + 1
            bar.update(1)
            record = {"train_loss": loss, "lr": self.scheduler.get_last_lr()[0], "grad_norm": grad_norm,
                      "skipped_steps": float(self.counters.skipped), **routing_figures}
            last = self.step == cfg.max_steps
            if self.step % cfg.log_every == 0 or last:
                elapsed = time.perf_counter() - window_start
                record["tokens_per_second"] = window_steps * self.tokens_per_step / elapsed
                if peak:
                    record["mfu"] = self.flops_per_token * record["tokens_per_second"] / (peak * self.dist.world_size)
                window_start, window_steps = time.perf_counter(), 0
            improved, best = False, None
            if self.step % cfg.eval_every == 0 or last:
                with pace.aside("eval"):
                    record["val_loss"] = self.validate()
                    improved = self._count_validation(record["val_loss"])
                    stop = self.counters.stopped_early
            if self.dist.is_main:
                self.log_metrics(record, self.step)  # every step to the tracker; console and history less often
            if "tokens_per_second" in record or "val_loss" in record:
                self.history.append({"step": self.step, **record})
                if self.dist.is_main:
                    bar.write(" ".join(filter(None, [step_line(self.step, cfg.max_steps, record),
                                                     self.model.routing_line(record)])))
            if improved:  # with this step's record in its history: a run that goes back to it keeps that
                with pace.aside("eval"):
                    best = self.save_checkpoint(name="best")  # kept apart from the last N checkpoints
            if self.step % cfg.checkpoint_every == 0 or last or stop:
                with pace.aside("save"):
                    if best is None:
                        self.save_checkpoint()
                    else:  # this step's best, just written: not written again
                        self.checkpoints.save_as(best, dist=self.dist)
            if not last and not stop and "val_loss" in record and self._plateaued():
                self._decay_from_best()
                self._show(bar)
                continue
            if self.deadline is not None and not last and not stop and self._replan(pace, first_step):
                bar.total = self.cfg.max_steps
        bar.close()
        if stop:
            log.warning("early stop at step %d: no val gain in %d validations (best val %.4f)",
                        self.step, self.cfg.early_stopping_patience, self.counters.best_val)
        seconds = time.perf_counter() - started
        best = self.counters.best_val
        return TrainResult(self.step, first_step or None, self.history, seconds,
                           trained * self.tokens_per_step / seconds if seconds else 0.0,
                           self.counters.skipped, best if math.isfinite(best) else None, stop,
                           self.counters.decay_began)

    def _show(self, bar: tqdm) -> None:
        bar.reset(self.cfg.max_steps)
        bar.update(self.step)

    def _plateaued(self) -> bool:
        """Whether train.decay_patience validation passes in a row have not improved on the best while a WSD
        schedule still holds its peak, and the run reads its corpus again (within the first epoch the validation
        loss has no repeats to overfit to: a pass without gain there is noise or a spike, not a plateau). The main
        rank decides for all (a run where it cannot apply asks no collective: every rank knows that alike)."""
        cfg = self.cfg
        if cfg.decay_patience is None or cfg.schedule != "wsd" or self.counters.decay_began is not None:
            return False
        return bool(self.dist.share(self._main_sees_plateau() if self.dist.is_main else None))

    def _main_sees_plateau(self) -> bool:
        cfg, counters = self.cfg, self.counters
        return (counters.evals_without_gain >= cfg.decay_patience and self.loader.order.epoch >= 1
                and counters.best_step is not None and counters.best_step > cfg.warmup_steps
                and lr_factor(self.step, cfg) == 1.0)

    def _decay_from_best(self) -> None:
        """train.decay_patience: go back to the best checkpoint's step (weights, optimizer, data position,
        generators) and begin the decay there, so it anneals the weights that generalised best, not those of the
        steps that overfitted since. The run then ends when the decay is done (it takes decay_fraction of the
        steps up to there), and its checkpoints of the abandoned steps are removed: the run resumes from the
        rewound path. Every rank does the same. A time budget's plan keeps the steps its pace bought (no re-plan
        is recorded): where the run went back follows from its own validation losses, so a run that reads the plan
        finds it again if its numbers are these, and a run of another learning rate or seed (which shares the
        plan: plan.NUMERICS_ONLY) finds its own."""
        planned, found_at, best = self.cfg.max_steps, self.step, self.checkpoints.best()
        if best is not None:  # None: unusable (checkpoints.best() said why), so the decay begins here
            self._restore(best)
        self.counters.decay_began = self.step
        self._revise_steps(decay_from(self.step, self.cfg))
        self.save_checkpoint()
        if self.dist.is_main:
            self.checkpoints.remove_after(self.step)
        self.dist.barrier()
        log.warning("train.decay_patience: no validation gain in %d passes by step %d; back to step %d (val %.4f) "
                    "to decay from there: the run ends at step %d, not %d", self.cfg.decay_patience, found_at,
                    self.step, self.counters.best_val, self.cfg.max_steps, planned)

    def _revise_steps(self, max_steps: int) -> None:
        self.cfg = self.cfg.model_copy(update={"max_steps": max_steps})
        self.scheduler.revise(self.cfg)

    def _replan(self, pace: "Pace", first_step: int) -> bool:
        """A time budget's revision of max_steps (see Deadline), at step REPLAN_FIRST and every tenth of the run,
        decided by the main rank for all. Returns whether max_steps changed."""
        cfg, deadline = self.cfg, self.deadline
        if self.step != REPLAN_FIRST and (self.step < REPLAN_FIRST or self.step % max(1, cfg.max_steps // 10)):
            return False
        wanted = None
        if self.dist.is_main:
            step_seconds = pace.step_seconds(self.step, first_step)
            eval_seconds, save_seconds = (pace.mean("eval", deadline.eval_seconds),
                                          pace.mean("save", deadline.save_seconds))
            left = (pace.started + deadline.seconds - time.perf_counter() - deadline.final_seconds - eval_seconds
                    - save_seconds)
            per_step = step_seconds + eval_seconds / cfg.eval_every + save_seconds / cfg.checkpoint_every
            wanted = min(self.step + max(1, int(left / per_step)), deadline.most_steps or math.inf)
            wanted = self._keeping_schedule(wanted)
        new = self.dist.share(wanted)
        if new is None or new == cfg.max_steps:
            return False
        log.warning("time budget: step %d of %d; at the measured pace the budget ends at step %d: re-planned",
                    self.step, cfg.max_steps, new)
        self._revise_steps(new)
        if self.dist.is_main:
            deadline.on_replan(self.step, new)
        return True

    def _keeping_schedule(self, wanted: int) -> int | None:
        """`wanted`, or the nearest step count to it under which the steps taken so far had the same learning
        rates (None: there is none but the current one, e.g. once the decay has begun)."""
        old = self.cfg.max_steps
        fits = lambda total: same_schedule(self.cfg, total, self.step)  # noqa: E731
        if fits(wanted):
            return wanted
        if wanted > old:  # the schedule is already fixed: growing it would change past rates
            return None
        low, high = wanted, old  # fits(old) holds; fits is monotone in total (a later decay start) for WSD
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (low, middle) if fits(middle) else (middle, high)
        return high if high != old else None

    def select_weights(self) -> int:
        """After fit(), train.select: load the best checkpoint's weights (lowest validation loss) unless the model
        already holds them, or keep the last step's. Returns the step whose weights the model now holds. Every
        rank calls it (loading is collective under FSDP)."""
        best = self.checkpoints.best() if self.cfg.select == "best" else None
        if best is None or best.step == self.step:
            return self.step
        log.warning("train.select=best: the model is step %d's (val %.4f), not the last step %d's",
                    best.step, self.counters.best_val, self.step)
        self.engine.load_weights_from(best)
        return best.step

    def prefer_average(self, selected: int) -> bool:
        """After select_weights() (which returned `selected`): validate the weight average (train.ema_horizon) and
        keep it instead where its validation loss is lower. Returns whether the model now holds the average.
        Every rank calls it."""
        if self.average is None or self.average.tensors is None:  # off, or no step decayed (schedule constant)
            return False
        selected_loss = self._validated_loss(selected)
        self.average.swap()
        average_loss = self.validate()
        kept = average_loss < selected_loss
        if not kept:
            self.average.swap()
        log.warning("train.ema_horizon: the average of the weights up to step %d validates at %.4f, step %d's "
                    "weights at %.4f: the model is %s", self.step, average_loss, selected, selected_loss,
                    "the average" if kept else f"step {selected}'s")
        return kept

    def _validated_loss(self, selected: int) -> float:
        """The validation loss of the weights select_weights() left in the model (step `selected`'s): the pass
        fit() made on them where there was one (the best step's, or the last step's), else a pass now."""
        if self.cfg.select == "best" and selected == self.counters.best_step:
            return self.counters.best_val
        last = self.history[-1] if self.history else {}
        if selected == self.step and last.get("step") == self.step and "val_loss" in last:
            return last["val_loss"]
        return self.validate()


def step_line(step: int, total: int, r: dict[str, float]) -> str:
    """`step 100/300 loss 4.1234 ppl 61.8 lr 1.20e-03 tok/s 12,345 [val 4.3000]`"""
    line = f"step {step}/{total} loss {r['train_loss']:.4f} ppl {math.exp(min(r['train_loss'], 50)):.1f} lr {r['lr']:.2e}"
    if "tokens_per_second" in r:
        line += f" tok/s {r['tokens_per_second']:,.0f}" + (f" mfu {r['mfu']:.1%}" if "mfu" in r else "")
    if "val_loss" in r:
        line += f" val {r['val_loss']:.4f}"
    return line


class Pace:
    """Where a run's seconds go: training steps, and the validation passes and checkpoints set aside from them."""

    def __init__(self, started: float):
        self.started, self.mark, self.mark_step, self.spent = started, started, None, {"eval": [], "save": []}
        self.aside_since_mark = 0.0

    @contextlib.contextmanager
    def aside(self, kind: str):
        begun = time.perf_counter()
        yield
        self.spent[kind].append(time.perf_counter() - begun)
        self.aside_since_mark += self.spent[kind][-1]

    def mean(self, kind: str, default: float) -> float:
        return sum(self.spent[kind]) / len(self.spent[kind]) if self.spent[kind] else default

    def step_seconds(self, step: int, first_step: int) -> float:
        """Seconds per training step since the last call (since the start at the first), validation passes and
        checkpoints excluded: the recent pace, which is what the rest of the run will see."""
        now, since = time.perf_counter(), first_step if self.mark_step is None else self.mark_step
        seconds = (now - self.mark - self.aside_since_mark) / max(1, step - since)
        self.mark, self.mark_step, self.aside_since_mark = now, step, 0.0
        return seconds
