"""The run plan: every choice that changes a training run's numbers and is made by measuring, made in one step,
once per configuration and machine class, and recorded in the repository.

What a plan decides: the precision (`train.precision: auto` — bf16 where it measures faster), the attention kernel
(`train.attention: auto`), `train.compile: auto`, the steps a `train.budget` buys and, under `model.size: auto`, the
shape and batch. Each of these follows a timing, and timings move with the machine's load; two runs of one
configuration that decided differently would train different weights. So the train stage decides once and writes
the decisions to a plan book (`plans/train.json`, tracked by git and DVC); every later run of the same
configuration on the same class of machine reads them back and measures nothing. Same commit + same machine class
= same bytes. Delete a configuration's entry (or the file) to measure again.

A machine class is what the numerics depend on: the device (CPU vendor and its widest matmul instructions, and the
thread count; or the GPU's name), and torch's version. A run on another class decides for itself, says so in one
line before training (its weights will differ from the recorded class's), and its entry is added beside the others.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from filelock import FileLock

from ultrathink.config import Budget, ModelConfig, TrainConfig
from ultrathink.config.fingerprint import TRAIN_BOOKKEEPING
from ultrathink.device import device_type, is_cuda, release_device_memory
from ultrathink.errors import StageError
from ultrathink.hashing import json_hash
from ultrathink.io import atomic_write_json
from ultrathink.model.kernels import AttentionKernel, choose_attention, fixed_kernel, label
from ultrathink.train.budget import (Probe, compile_pays, probe_shape, step_seconds_side_by_side, steps_for,
                                     training_seconds, warmup_for)
from ultrathink.train import sizing
from ultrathink.train.engine import autocast_dtype, cannot_compile
from ultrathink.train.precision import cpu_peak_gflops, peak_flops
from ultrathink.train.sizing import Sizing, round_figures

log = logging.getLogger(__name__)

GUESS_UTILISATION = 0.3  # model.size auto's first guess at the share of the device's matmul peak a step reaches
BF16_MIN_GAIN = 1.2  # precision auto takes bf16 on a CPU only when its matmuls are at least this much faster
# A time plan that keeps dropout sizes its shape again at dropout's speed only where a step with it measured more than
# this much slower: a fifth of the tokens moves the law's prediction by about sizing.MEASURE_MARGIN, within the error
# of the step-cost model that sized the shape, so a smaller slowdown would only spend the budget on probes.
RESIZE_SLOWDOWN = 1.2


# ---- machine class -----------------------------------------------------------------------------------------------
def _cpu_flags() -> tuple[str, set[str]]:
    vendor, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "vendor_id":
                vendor = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    return vendor, flags


def cpu_isa(flags: set[str]) -> str:
    """The widest matmul instruction set of a CPU: what decides its kernels and whether bf16 is native."""
    for isa in ("amx_bf16", "avx512_bf16", "avx512f", "avx2"):
        if isa in flags:
            return isa
    return "baseline"


def machine_class(device: str) -> str:
    """`cpu/AuthenticAMD/avx512_bf16/2 threads/torch 2.13` or `cuda/NVIDIA H100 80GB HBM3/torch 2.13`: machines of
    one class compute the same bits from the same plan. A CPU where torch.compile cannot build a step (no C++
    compiler or no Python headers: engine.cannot_compile) is a class of its own (`.../torch 2.13/no torch.compile`),
    so a plan recorded where it could (which may compile) is not its plan."""
    version = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    if is_cuda(device):
        return f"cuda/{torch.cuda.get_device_name(device)}/torch {version}/cuda {torch.version.cuda}"
    vendor, flags = _cpu_flags()
    without = "/no torch.compile" if cannot_compile(device) else ""
    return f"cpu/{vendor}/{cpu_isa(flags)}/{torch.get_num_threads()} threads/torch {version}{without}"


# ---- what a plan holds -------------------------------------------------------------------------------------------
@dataclass
class Plan:
    """What a run resolved to: everything a later run of the same configuration needs to compute the same bits."""
    budget: str | None
    max_steps: int
    warmup_steps: int
    tokens_per_step: int
    flops_per_token: int
    precision: str = "fp32"
    attention: dict = field(default_factory=lambda: AttentionKernel().to_dict())
    compile: bool = False  # train.compile, decided (auto) from the budget and the probe
    probe: Probe | None = None
    sizing: dict = field(default_factory=dict)  # model.size: auto's choice and its reasons (sizing.py)
    attention_ms: dict = field(default_factory=dict)  # what attention auto measured
    replans: list = field(default_factory=list)  # [step, new max_steps] as a time budget's run re-planned
    machine: str = ""  # the machine class it was made on
    weight_decay: float | None = None  # train.weight_decay's, or (null) decided from the planned epochs
    seq_len_warmup_steps: int = 0  # train.seq_len_warmup of the planned steps (kept when a time budget re-plans)
    # model.size auto under a time or FLOPs budget: the steps past which the law credits the chosen model nothing
    # (sizing.saturating_tokens); neither the plan nor a time budget's re-plans go past them. None: no such bound.
    step_ceiling: int | None = None

    @classmethod
    def from_dict(cls, raw: dict) -> "Plan":
        return cls(**{**raw, "probe": Probe(**raw["probe"]) if raw.get("probe") else None})

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def kernel(self) -> AttentionKernel:
        return AttentionKernel(**self.attention)

    def decisions(self) -> dict:
        """What fixes the numerics from the first step: part of the checkpoint fingerprint. Not max_steps: a time
        budget's run revises it while training (before the schedule's decay, so the steps taken do not change)."""
        return {"precision": self.precision, "attention": self.attention, "compile": self.compile,
                "warmup_steps": self.warmup_steps, "shape": self.sizing.get("shape"),
                "batch_size": self.sizing.get("batch_size"), "dropout": self.sizing.get("dropout"),
                "weight_decay": self.weight_decay, "seq_len_warmup_steps": self.seq_len_warmup_steps}

    def summary(self) -> dict:
        """The decisions and the steps taken, without the timings behind them (those stay in the plan book and the
        MLflow run): what a model directory records, the same bytes for the same decisions."""
        return {**self.decisions(), "budget": self.budget, "max_steps": self.max_steps,
                "tokens_per_step": self.tokens_per_step, "machine": self.machine}

    def mlflow_params(self) -> dict[str, object]:
        params = {"plan.max_steps": self.max_steps, "plan.warmup_steps": self.warmup_steps,
                  "plan.tokens": self.max_steps * self.tokens_per_step, "plan.precision": self.precision,
                  "plan.attention": label(self.kernel), "plan.compile": self.compile, "plan.machine": self.machine,
                  "plan.weight_decay": self.weight_decay, "plan.seq_len_warmup_steps": self.seq_len_warmup_steps}
        if self.step_ceiling is not None:
            params["plan.step_ceiling"] = self.step_ceiling
        if self.probe:
            params.update({"plan.step_seconds": round(self.probe.step_seconds, 4),
                           "plan.probe_seconds": round(self.probe.seconds, 2)})
        params.update({f"plan.model.{k}": v for k, v in self.sizing.get("shape", {}).items()})
        if self.sizing:
            params.update({"plan.batch_size": self.sizing["batch_size"],
                           "plan.model.dropout": self.sizing.get("dropout")})
        return params


def apply_plan(plan: Plan, model_cfg, train_cfg):
    """The model and train configs a plan resolved: shape and batch, steps, warmup, compile, precision and weight
    decay."""
    if plan.sizing:
        model_cfg, train_cfg = _sized(model_cfg, train_cfg, Sizing.from_dict(plan.sizing))
    decided = {"max_steps": plan.max_steps, "warmup_steps": plan.warmup_steps, "compile": plan.compile,
               "precision": plan.precision}
    if plan.weight_decay is not None:  # None: a plan from before it was decided, of a configuration that set it
        decided["weight_decay"] = plan.weight_decay
    return model_cfg, train_cfg.model_copy(update=decided)


def global_tokens(model_cfg, train_cfg) -> int:
    """The tokens of one optimizer step: the global batch's sequences (every rank's micro-batches) × their length."""
    return train_cfg.batch_size * train_cfg.grad_accum * model_cfg.seq_len


def _sized(model_cfg, train_cfg, sized):
    dropout = model_cfg.dropout if sized.dropout is None else sized.dropout  # None: a plan from before it was sized
    return (model_cfg.model_copy(update={**asdict(sized.shape), "dropout": dropout, "size": "manual"}),
            train_cfg.model_copy(update={"batch_size": sized.batch_size}))


# ---- the plan book -----------------------------------------------------------------------------------------------
# Knobs that change neither a decision nor what it was measured on: the bookkeeping knobs (they name no checkpoint's
# configuration either) and whether the parent's optimizer state is loaded. The cadence of validation and checkpoints
# counts only under a time budget, whose steps are planned around its cost (budget.steps_for). A knob hashed here for
# nothing re-plans a run that changes it, and a re-measured plan may decide otherwise on a busy machine, which changes
# the checkpoints' fingerprint: turning train.calibrate off then trained again instead of resuming.
TIMED_CADENCE = frozenset({"eval_every", "eval_batches", "checkpoint_every"})
# Knobs that change the weights but neither a decision nor what it was measured on: no timing depends on them and
# nothing the plan decides is derived from them (a plateau's end, which is, is not recorded in the plan: trainer.py,
# _decay_from_best). Runs that differ only in these share one plan, so a sweep of the learning rate or the seed under
# a time budget and model.size auto trains one shape for the same steps, measured once, instead of shapes and steps
# that a busy machine's probes chose apart.
NUMERICS_ONLY = frozenset({"seed", "lr", "min_lr_ratio", "beta1", "beta2", "embedding_init"})
NOT_PLANNED = (TRAIN_BOOKKEEPING - TIMED_CADENCE) | {"init_optimizer"} | NUMERICS_ONLY


def configuration_key(model_cfg, train_cfg, vocab_size: int, train_tokens: int, val_tokens: int,
                      world_size: int) -> str:
    """What a plan is measured for: the model and train knobs (not NOT_PLANNED's), the vocabulary, the splits'
    sizes, and the cadence of validation and checkpoints and the number of ranks only where a time budget makes the
    plan depend on them. Otherwise a run resumed on another number of ranks, or validating more often, reads the
    same plan, so its checkpoints' fingerprint is the same."""
    timed = train_cfg.budget is not None and Budget.parse(train_cfg.budget).kind == "seconds"
    not_planned = NOT_PLANNED if timed else NOT_PLANNED | TIMED_CADENCE
    return json_hash({"model": model_cfg.model_dump(), "train": train_cfg.model_dump(exclude=set(not_planned)),
                      "vocab_size": vocab_size, "tokens": [train_tokens, val_tokens],
                      "world_size": world_size if timed else None})


class PlanBook:
    """`{machine class: {"matmul_gflops": {...}, "plans": {configuration key: plan}}}` in one JSON file. Read and
    written under a lock beside it (per machine: two runs in one project directory take turns)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.lock = FileLock(str(self.path.with_name(f".{self.path.name}.lock")))

    def read(self) -> dict:
        if not self.path.is_file():
            return {}
        try:
            return json.loads(self.path.read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"{self.path}: not a plan book ({error}); delete it to measure again") from None

    def plan(self, machine: str, key: str) -> Plan | None:
        raw = self.read().get(machine, {}).get("plans", {}).get(key)
        return Plan.from_dict(raw) if raw else None

    def others(self, machine: str, key: str) -> dict[str, Plan]:
        """Plans of this configuration recorded on other machine classes."""
        return {m: Plan.from_dict(entry["plans"][key]) for m, entry in self.read().items()
                if m != machine and key in entry.get("plans", {})}

    def matmul_gflops(self, machine: str) -> dict[str, float]:
        return self.read().get(machine, {}).get("matmul_gflops", {})

    def record(self, machine: str, key: str | None = None, plan: Plan | None = None,
               matmul_gflops: dict[str, float] | None = None) -> None:
        with self.lock:
            book = self.read()
            entry = book.setdefault(machine, {"matmul_gflops": {}, "plans": {}})
            if matmul_gflops:
                entry["matmul_gflops"].update(matmul_gflops)
            if plan is not None:
                entry["plans"][key] = plan.to_dict()
            atomic_write_json(self.path, dict(sorted(book.items())))


# ---- deciding ----------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _measure_peak(dtype_name: str, device: str) -> float:
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    return cpu_peak_gflops(dtype, device=device)


CPU_PEAK_DTYPES = ("fp32", "bf16")  # the precisions a CPU's matmul peak is measured in


def peak_dtypes(precision: str) -> tuple[str, ...]:
    """Whose matmul peaks a run in `precision` needs: both to decide `auto`, else its own (MFU's denominator); none
    for fp16, which a CPU's peak is not measured in."""
    return CPU_PEAK_DTYPES if precision == "auto" else tuple(d for d in CPU_PEAK_DTYPES if d == precision)


def cpu_matmul_gflops(book: PlanBook | None, machine: str, device: str, dtypes: tuple[str, ...]) -> dict[str, float]:
    """The CPU's matmul peak in each of `dtypes` (GFLOP/s): read from the book, else measured once and recorded.
    Only what is asked is measured: an AVX2-only CPU takes ~1.3 s to time bf16 alone, which a run in fp32 never
    uses."""
    known = book.matmul_gflops(machine) if book else {}
    measured = {name: round(_measure_peak(name, device), 1) for name in dtypes if name not in known}
    if measured and book:
        book.record(machine, matmul_gflops=measured)
    return {**known, **measured}


def decide_precision(requested: str, device: str, gflops: dict[str, float] | None) -> str:
    """`auto` → bf16 on a GPU that has it; on a CPU only where its matmuls measured BF16_MIN_GAIN× faster (on a CPU
    without native bf16 they are ~40× slower)."""
    if requested != "auto":
        return requested
    if is_cuda(device):
        return "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp32"
    return "bf16" if gflops["bf16"] >= BF16_MIN_GAIN * gflops["fp32"] else "fp32"


def peak_for(precision: str, device: str, gflops: dict[str, float] | None) -> float | None:
    """FLOP/s of the device in `precision`: the denominator of MFU. A CPU's is its measured matmul peak (recorded
    with the plan); a GPU's, its datasheet figure (precision.peak_flops)."""
    if is_cuda(device) or not gflops or precision not in gflops:
        return peak_flops(precision, device)
    return gflops[precision] * 1e9


def decide_attention(setting: str, model_cfg, batch_size: int, precision: str,
                     device: str) -> tuple[AttentionKernel, dict[str, float]]:
    if setting == "flash" and precision == "fp32" and is_cuda(device):  # SDPA would raise "No available kernel"
        raise StageError("train.attention flash has no fp32 kernel on a GPU (FlashAttention computes in bf16 or "
                         "fp16): set train.precision bf16 (or auto), or train.attention auto")
    if setting != "auto":
        return fixed_kernel(setting), {}
    m = model_cfg
    return choose_attention(setting, batch_size, m.n_heads, m.n_kv_heads, m.seq_len, m.head_dim, m.dropout, device,
                            autocast_dtype(precision, device))


@dataclass
class Decided:
    """A plan and how it came about: `measured` (this run decided, so it may revise a time budget's steps while
    training) or read back from the book; the plans other machine classes recorded for this configuration."""
    plan: Plan
    measured: bool
    others: dict[str, Plan]
    peak_flops: float | None
    key: str  # the configuration's key in the book

    def describe(self) -> str:
        """One line on the plan: where it came from, what it decided, what a budget bought (and, under model.size auto,
        the shape chosen and why)."""
        plan = self.plan
        origin = "measured on" if self.measured else "recorded for"
        line = (f"plan: {plan.precision}, attention {label(plan.kernel)}"
                f"{', compiled' if plan.compile else ''}, {plan.max_steps} steps "
                f"({plan.max_steps * plan.tokens_per_step:,} tokens)")
        if plan.budget:
            line += f" for budget {plan.budget}"
        if plan.probe:
            line += (f", at {plan.probe.step_seconds * 1e3:.0f} ms/step measured (probe {plan.probe.seconds:.1f} s, "
                     f"validation {plan.probe.eval_seconds:.2f} s)")
        if plan.step_ceiling is not None and plan.max_steps == plan.step_ceiling:
            corpus = plan.sizing["tokens"] / plan.sizing["epochs"]
            line += (f", as many as the law credits this model with ({plan.max_steps * plan.tokens_per_step / corpus:.1f}"
                     f" epochs): the rest of the budget is left unspent")
        if plan.replans:
            line += f", re-planned while training: {', '.join(f'step {s} → {n}' for s, n in plan.replans)}"
        if plan.weight_decay is not None:
            line += f", weight decay {plan.weight_decay:g}"
        if plan.sizing:
            line += "; " + Sizing.from_dict(plan.sizing).explain()
        return f"{line} ({origin} {plan.machine})"


def plan_run(model_cfg, train_cfg, vocab_size: int, train_tokens, val_tokens, device: str, world_size: int = 1,
             book: PlanBook | None = None, probe: Callable[..., Probe] | None = None,
             side_by_side: Callable[[list], tuple[list[float], float]] | None = None) -> Decided:
    """The one planning step: read this configuration's plan for this machine class from `book`, or decide it
    (measuring what must be measured) and record it there. Without a book (a probe, a benchmark) it decides.
    `probe` and `side_by_side` measure (budget.probe_shape, budget.step_seconds_side_by_side: in this process
    unless given; a `probe` given alone, nothing is measured side by side)."""
    missing = cannot_compile(device) if train_cfg.compile is True else None
    if missing:  # before anything is measured or written
        raise StageError(f"train.compile true: torch.compile cannot build a step on this {device_type(device)}: "
                         f"{missing}; or set train.compile auto (it then trains eagerly) or false")
    machine = machine_class(device)
    key = configuration_key(model_cfg, train_cfg, vocab_size, len(train_tokens), len(val_tokens), world_size)
    gflops = (cpu_matmul_gflops(book, machine, device, peak_dtypes(train_cfg.precision)) if not is_cuda(device)
              else None)
    recorded = book.plan(machine, key) if book else None
    others = book.others(machine, key) if book else {}
    if recorded is not None:
        return Decided(recorded, False, others, peak_for(recorded.precision, device, gflops), key)
    if probe is None:
        probe = functools.partial(_probe_here, vocab_size, train_tokens, val_tokens, device)
        side_by_side = side_by_side or functools.partial(step_seconds_side_by_side, vocab_size=vocab_size,
                                                         train_tokens=train_tokens, val_tokens=val_tokens,
                                                         device=device)
    plan = decide(model_cfg, train_cfg, vocab_size, train_tokens, device, world_size, gflops, probe, side_by_side)
    plan.machine = machine
    if others:
        log.warning("%s", other_class_line(plan, others))
    if book:
        book.record(machine, key, plan)
    return Decided(plan, True, others, peak_for(plan.precision, device, gflops), key)


def _probe_here(vocab_size: int, train_tokens, val_tokens, device: str, model_cfg, train_cfg, kernel) -> Probe:
    return probe_shape(model_cfg, train_cfg, vocab_size, train_tokens, val_tokens, device, kernel)


class RankProbes:
    """A time budget's probes on all of a run's ranks. The main rank decides the plan and, at each probe, tells the
    other ranks what it probes; they run the same probe with it (`follow`), so its steps and checkpoint pay the
    run's collectives, until the main rank sends the plan."""

    def __init__(self, dist, vocab_size: int, train_tokens, val_tokens):
        self.dist, self.vocab_size, self.train_tokens, self.val_tokens = dist, vocab_size, train_tokens, val_tokens

    def probe(self, model_cfg: ModelConfig, train_cfg: TrainConfig, kernel: AttentionKernel | None) -> Probe:
        """On the main rank, inside plan_run."""
        self.dist.share({"probe": self._message(model_cfg, train_cfg, kernel)})
        return self._run(model_cfg, train_cfg, kernel)

    def side_by_side(self, configs: list) -> tuple[list[float], float]:
        """On the main rank, inside plan_run: budget.step_seconds_side_by_side on every rank."""
        self.dist.share({"side_by_side": [self._message(*config) for config in configs]})
        return self._side_by_side(configs)

    def follow(self) -> dict:
        """On the other ranks: each probe the main rank announces, then its plan message."""
        while "plan" not in (message := self.dist.share(None)):
            if "probe" in message:
                self._run(*self._config(message["probe"]))
            else:
                self._side_by_side([self._config(config) for config in message["side_by_side"]])
        return message

    @staticmethod
    def _message(model_cfg, train_cfg, kernel) -> list:
        return [model_cfg.model_dump(mode="json"), train_cfg.model_dump(mode="json"),
                kernel.to_dict() if kernel else None]

    @staticmethod
    def _config(message: list) -> tuple:
        model, train, kernel = message
        return (ModelConfig.model_validate(model), TrainConfig.model_validate(train),
                AttentionKernel(**kernel) if kernel else None)

    def _run(self, model_cfg, train_cfg, kernel) -> Probe:
        return probe_shape(model_cfg, train_cfg, self.vocab_size, self.train_tokens, self.val_tokens,
                           self.dist.device, kernel, self.dist)

    def _side_by_side(self, configs: list) -> tuple[list[float], float]:
        return step_seconds_side_by_side(configs, self.vocab_size, self.train_tokens, self.val_tokens,
                                         self.dist.device, self.dist)


def plan_on_main(dist, decide: Callable[[], Decided], probes: RankProbes | None = None) -> Decided:
    """The plan of a run on `dist`'s ranks: the main rank `decide`s (reads the book, or measures and records), the
    others follow its plan and record nothing; with `probes` they take part in its probes. They take its peak
    FLOP/s too (MFU's denominator): on a CPU, a rank measuring its own would spend a second or more on it."""
    if dist.is_main:
        decided = decide()
        dist.share({"plan": decided.plan.to_dict(), "measured": decided.measured, "peak_flops": decided.peak_flops})
        return decided
    message = probes.follow() if probes else dist.share(None)
    return Decided(Plan.from_dict(message["plan"]), message["measured"], {}, message["peak_flops"], "")


def other_class_line(plan: Plan, others: dict[str, Plan]) -> str:
    machine, first = next(iter(others.items()))
    def brief(p: Plan) -> str:
        return f"{p.precision}, attention {label(p.kernel)}, {p.max_steps} steps"
    return (f"plan: this machine ({plan.machine}) is not the class this configuration was planned on ({machine}: "
            f"{brief(first)}); decided here: {brief(plan)}. The weights will differ from that class's.")


def decide(model_cfg, train_cfg, vocab_size: int, train_tokens, device: str, world_size: int,
           gflops: dict[str, float] | None, probe: Callable[..., Probe],
           side_by_side: Callable[[list], tuple[list[float], float]] | None = None) -> Plan:
    """Precision, then (model.size auto) the shape, the attention kernel for it, the probe a time budget or
    compile auto needs, the steps, compile and (train.weight_decay null) the weight decay for the epochs planned."""

    precision = decide_precision(train_cfg.precision, device, gflops)
    weight_decay = train_cfg.weight_decay
    if weight_decay is None:  # probes step with the base decay: its value costs nothing per step
        train_cfg = train_cfg.model_copy(update={"weight_decay": sizing.WEIGHT_DECAY})
    if train_cfg.precision == "auto":
        log.info("precision auto → %s (matmul peak: %s)", precision,
                 ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in (gflops or {}).items()) or "GPU")
    train_cfg = train_cfg.model_copy(update={"precision": precision})
    peak = peak_for(precision, device, gflops)
    budget = Budget.parse(train_cfg.budget) if train_cfg.budget is not None else None

    def measure(model_cfg, train_cfg) -> tuple[AttentionKernel, dict, Probe]:
        kernel, timings = decide_attention(train_cfg.attention, model_cfg, train_cfg.batch_size, precision, device)
        return kernel, timings, probe(model_cfg, train_cfg, kernel)

    sized, probes = None, []
    lost, ceiling = 0.0, None  # seconds of probes that ran out of memory; the smallest shape that did (params)

    def spent() -> float:
        """The seconds probing has taken from the budget so far, the probes that ran out of memory included."""
        return lost + sum(p[2].seconds for _, p in probes)

    def probe_unless_last(model_cfg, train_cfg) -> bool:
        """Probe this configuration unless the last probe was of it; whether it probed."""
        if probes and probes[-1][0] == (model_cfg, train_cfg.batch_size):
            return False
        probes.append(((model_cfg, train_cfg.batch_size), measure(model_cfg, train_cfg)))
        return True

    def probe_last(model_cfg, train_cfg) -> None:
        """Make this configuration's probe the last one: moved there if it was probed, else probed."""
        taken = [p for p in probes if p[0] == (model_cfg, train_cfg.batch_size)]
        if taken:
            probes.remove(taken[-1])
            probes.append(taken[-1])
        else:
            probe_unless_last(model_cfg, train_cfg)

    if model_cfg.size == "auto":
        corpus = len(train_tokens)
        if budget.kind == "seconds":
            # First guess from the device's matmul peak at a typical small-model utilisation, then once more from the
            # step time measured on that guess: the peak's share of it and the rest, which grows with layers × width
            # (sizing.StepCost), so shapes that use the device better are seen to. Each guess is sized for the seconds
            # the probes so far leave. Shapes are sized at the speed without dropout (the loss law's evidence ran at
            # it); then, where dropout could pay were it free (model.dropout null), its step at the chosen shape is
            # probed and the law decides at that speed. Dropout kept, the shape is sized again at dropout's speed, as a
            # dropout set in params.yaml is: on a CPU a step with it can take 1.3-1.8× as long, and the shape sized for
            # the faster step then read its corpus half as often as planned. Not for a slowdown within RESIZE_SLOWDOWN
            # (a GPU's: 1.01-1.06× on an H200). The shapes probed are compared at the tokens their measured speed buys
            # in the seconds left for training (budget.training_seconds: less the probes, the first steps' extra, and
            # each shape's own validation and checkpoint costs), as sizing.best_measured says; on a CPU, whose speed
            # wanders between probes, those that could be ahead of the choice (sizing.could_overtake) at step times
            # measured again side by side with it (again_side_by_side).
            peak_rate = (peak or 1e11) * world_size
            cost = sizing.StepCost(round_figures(peak_rate * GUESS_UTILISATION))

            def sized_for(model_cfg, shape_keys: dict | None = None) -> Sizing:
                fixed = model_cfg if shape_keys is None else model_cfg.model_copy(update=shape_keys)
                return sizing.choose(fixed, vocab_size, corpus, seconds=max(1.0, budget.amount - spent()), cost=cost,
                                     batch_size=train_cfg.batch_size, weight_decay=weight_decay,
                                     below_params=ceiling)

            def probed_as(model_cfg, sized: Sizing):
                """The model and train configs a probe of `sized` runs: at model_cfg's dropout, 0 where null (a
                dropout the law would keep is probed after the shape is chosen)."""
                shaped_model, shaped_train = _sized(model_cfg, train_cfg, sized)
                return shaped_model.model_copy(update={"dropout": model_cfg.dropout or 0.0}), shaped_train

            def fit_cost(sized: Sizing, taken: Probe, tokens_per_step: int) -> None:
                nonlocal cost
                cost = sizing.StepCost.fitted(round_figures(peak_rate), sized.shape, sized.flops_per_token,
                                              taken.step_seconds / tokens_per_step)

            def probe_sized(model_cfg, probed: list, sized: Sizing, why: str) -> bool | None:
                """Probe `sized` (at model_cfg's dropout, 0 where null), add it to `probed` and fit the step cost
                to it: True; False where the last probe was of it; None where it ran out of the device's memory
                (left out, with every larger shape)."""
                nonlocal lost, ceiling
                shaped_model, shaped_train = probed_as(model_cfg, sized)
                started = time.perf_counter()
                try:
                    if not probe_unless_last(shaped_model, shaped_train):
                        return False
                except torch.OutOfMemoryError:
                    # A shape the sizing chose, not the user: one that does not fit this device is left out with
                    # every larger one, and the choice made again (a time budget's first guess on a small GPU).
                    # Ranks probe together: one that ran out has left the others in a collective, so it is raised.
                    if world_size > 1:
                        raise
                    lost += time.perf_counter() - started
                    ceiling = sized.params
                    release_device_memory(device)
                    log.warning("model.size auto: %s (%.1fM params) ran out of %s memory in its probe; choosing "
                                "among smaller shapes", sized.shape, sized.params / 1e6, device)
                    return None
                taken = probes[-1][1][2]
                tokens = global_tokens(shaped_model, shaped_train)
                probed.append((sized, taken, tokens, shaped_train, why))
                fit_cost(sized, taken, tokens)
                return True

            def at_speed(model_cfg, shaped: Sizing, taken: Probe, tokens_per_step: int, cfg,
                         why: str) -> tuple[Sizing, float]:
                """A probed shape at the tokens its measured speed buys in the seconds left (sizing.
                at_measured_speed), and those tokens before saturation cut them."""
                seconds_per_token = taken.step_seconds / tokens_per_step
                seconds = training_seconds(budget, cfg, taken, spent())
                timed = sizing.at_measured_speed(shaped, corpus, seconds, seconds_per_token, model_cfg.dropout,
                                                 weight_decay)
                return timed, seconds / seconds_per_token

            def again_side_by_side(model_cfg, probed: list, which: list[int]) -> None:
                """Measure the step of the probed shapes `which` again, side by side (a CPU's speed wanders between
                probes: sizing.PROBE_SPREAD), and take those step times for them: in `probed`, and as each one's
                latest probe (the budget pays for it; the steps of the one chosen come from it)."""
                configs, latest = [], []
                for i in which:
                    shaped_model, shaped_train = probed_as(model_cfg, probed[i][0])
                    key = (shaped_model, shaped_train.batch_size)
                    latest.append(next(entry for entry in reversed(probes) if entry[0] == key))
                    configs.append((shaped_model, shaped_train, latest[-1][1][0]))
                steps, seconds = side_by_side(configs)
                for i, step, (key, (kernel, timings, _)) in zip(which, steps, latest):
                    sized, taken, tokens, cfg, why = probed[i]
                    again = replace(taken, step_seconds=step, seconds=seconds / len(which))
                    probes.append((key, (kernel, timings, again)))
                    probed[i] = (sized, again, tokens, cfg, f"{why}, again side by side")
                log.info("time budget: %s probed shapes measured again side by side: %s", len(which),
                         ", ".join(f"{probed[i][0].shape.d_model}x{probed[i][0].shape.n_layers} batch "
                                   f"{probed[i][0].batch_size} {step * 1e3:.0f} ms" for i, step in zip(which, steps)))

            def size_in_seconds(model_cfg, probed: list) -> Sizing:
                """The shape (and batch) for the seconds left, at model_cfg's dropout (0 where null): probed until
                the step cost fitted to the probes chooses a shape already probed, then the best measured.
                `probed` may hold a shape already measured at that dropout."""
                while len(probed) < 2:
                    if probe_sized(model_cfg, probed, sized_for(model_cfg),
                                   "refitted choice" if probed else "first guess") is False:  # just probed
                        break
                # One probe more: the choice at the last fitted cost if it was not probed, else the law's runner-up
                # there when near enough for that cost's error to reverse them (sizing.MEASURE_MARGIN).
                final = sized_for(model_cfg)
                measured_shapes = [shaped.shape for shaped, *_ in probed]
                unprobed = final.shape not in measured_shapes
                contender = final.shape if unprobed else sizing.near_runner_up(final)
                if contender is not None and contender not in measured_shapes:
                    probe_sized(model_cfg, probed, sized_for(model_cfg, asdict(contender)),
                                "last choice" if unprobed else "near runner-up")
                timed = [at_speed(model_cfg, *entry) for entry in probed]
                best = sizing.best_measured([t for t, _ in timed])
                near = [i for i, (t, _) in enumerate(timed) if t is not best and sizing.could_overtake(t, best, corpus)]
                if near and side_by_side is not None and device_type(device) == "cpu":
                    again_side_by_side(model_cfg, probed, [next(i for i, (t, _) in enumerate(timed) if t is best),
                                                           *near])
                    timed = [at_speed(model_cfg, *entry) for entry in probed]
                    best = sizing.best_measured([t for t, _ in timed])
                bought = next(tokens for t, tokens in timed if t is best)
                records = [sizing.probed_record(t, why) for (t, _), (*_, why) in zip(timed, probed)]
                sized = replace(best, measured=records)
                # Seconds to spare (the tokens saturated) buy more steps at a smaller batch on a GPU: measured, not
                # predicted, since a step there takes about as long at half the batch (sizing.spare_batch).
                batch = None if train_cfg.batch_size is not None else sizing.spare_batch(
                    sized, bought, corpus, device, world_size, train_cfg.grad_accum)
                if batch is not None and probe_sized(model_cfg, probed, replace(sized, batch_size=batch),
                                                     "spare seconds: a smaller batch"):
                    smaller, _ = at_speed(model_cfg, *probed[-1])
                    sized = replace(smaller, measured=sized.measured + [sizing.probed_record(smaller, probed[-1][-1])])
                probe_last(*probed_as(model_cfg, sized))
                return sized

            sized = size_in_seconds(model_cfg, [])
            if model_cfg.dropout is None and sized.dropout:
                undropped_step = probes[-1][1][2].step_seconds
                shaped_model, shaped_train = _sized(model_cfg, train_cfg, sized)
                probe_unless_last(shaped_model, shaped_train)
                dropped = probes[-1][1][2]
                slowdown = dropped.step_seconds / undropped_step
                level = sized.dropout
                sized = sizing.with_dropout(sized, corpus, slowdown, weight_decay)  # tokens: those without dropout
                resize = sized.dropout and slowdown > RESIZE_SLOWDOWN
                log.info("model.dropout null: a step with dropout %g measured %.2f× as long at this shape; %s",
                         level, slowdown, "kept, so the shape is sized again at that speed" if resize
                         else "kept" if sized.dropout else "predicted not to pay: 0")
                if resize:
                    kept = model_cfg.model_copy(update={"dropout": sized.dropout})
                    tokens = global_tokens(shaped_model, shaped_train)
                    fit_cost(sized, dropped, tokens)
                    undropped_records = sized.measured
                    sized = size_in_seconds(kept, [(sized, dropped, tokens, shaped_train, "the choice without dropout")])
                    sized = replace(sized, measured=undropped_records + [
                        {**record, "why": f"{record['why']}, dropout {kept.dropout:g}"} for record in sized.measured])
        else:
            sized = sizing.choose(model_cfg, vocab_size, corpus, batch_size=train_cfg.batch_size,
                                  weight_decay=weight_decay,
                                  **{"flops" if budget.kind == "flops" else "tokens": budget.amount})
            if budget.kind == "flops" and train_cfg.batch_size is None:  # the same tokens at any batch
                batch = sizing.spare_batch(sized, budget.amount / sized.flops_per_token, corpus, device, world_size,
                                           train_cfg.grad_accum)
                sized = sized if batch is None else replace(sized, batch_size=batch)
        model_cfg, train_cfg = _sized(model_cfg, train_cfg, sized)
    tokens_per_step = global_tokens(model_cfg, train_cfg)
    flops_per_token = sizing.counts(sizing.Shape.of(model_cfg), model_cfg, vocab_size)[2]
    measured = None
    if budget is not None and (budget.kind == "seconds" or train_cfg.compile == "auto"):
        probe_last(model_cfg, train_cfg)
        last = probes[-1][1][2]
        measured = Probe(last.step_seconds, last.first_steps_extra, last.eval_seconds, last.save_seconds,
                         spent(), last.ranks)
    if probes:
        kernel, timings = probes[-1][1][:2]
    else:
        kernel, timings = decide_attention(train_cfg.attention, model_cfg, train_cfg.batch_size, precision, device)
    max_steps = steps_for(budget, tokens_per_step, flops_per_token, train_cfg, measured) if budget else \
        train_cfg.max_steps
    step_ceiling = None
    if sized is not None and budget.kind != "tokens":
        step_ceiling = math.ceil(sizing.saturated(replace(sized, tokens=math.inf), len(train_tokens)).tokens
                                 / tokens_per_step)
        max_steps = min(max_steps, step_ceiling)
    warmup = warmup_for(max_steps, train_cfg)
    compile = compile_pays(train_cfg, model_cfg, max_steps, measured, device)
    epochs = max_steps * tokens_per_step / len(train_tokens)
    if weight_decay is None:
        weight_decay = sizing.weight_decay_for(epochs)
    seq_len_warmup = train_cfg.seq_len_warmup
    if seq_len_warmup is None:
        # Compiled, each context length is another compile (~35 s at d192): more than the ~5% of a run that the
        # short steps save.
        seq_len_warmup = 0.0 if compile else sizing.seq_len_warmup_for(epochs)
    return Plan(train_cfg.budget, max_steps, warmup, tokens_per_step, flops_per_token, precision,
                kernel.to_dict(), compile, measured, sized.to_dict() if sized else {}, timings,
                weight_decay=weight_decay, seq_len_warmup_steps=round(seq_len_warmup * max_steps),
                step_ceiling=step_ceiling)
