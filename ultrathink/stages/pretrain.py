"""The train stage on this process, alone or as one of the ranks the stage launched (ultrathink/stages/train.py):
pretrain the UltraThink decoder on the packed tokens; write the final weights (and keep resumable checkpoints). One
MLflow run per trained model carries its params, per-step curves and lineage."""

import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import NamedTuple

import torch

from ultrathink.config import Budget, Params
from ultrathink.config.fingerprint import training_params_hash
from ultrathink.hashing import directory_hash, file_sha256, json_hash
from ultrathink.data.tokens import load_split, read_meta
from ultrathink.io import atomic_dir, atomic_write_json
from ultrathink.lineage import LINEAGE_FILE, TRAINING_CODE, code_hash, lineage_tags
from ultrathink.model import UltraThink
from ultrathink.model.model import WEIGHTS_FILE
from ultrathink.registry.models import is_mlflow_uri, resolve_named_model
from ultrathink.tokenizer import tokenizer_hash
from ultrathink.train.averaging import ema_horizon_for
from ultrathink.train.budget import checkpoints_apart
from ultrathink.train.calibration import Calibration, fit_temperature, fold_temperature
from ultrathink.train.checkpoint import CheckpointManager, Fingerprint
from ultrathink.train.distributed import Distributed, setup
from ultrathink.train.embedding_init import init_from_corpus
from ultrathink.train.engine import build_engine
from ultrathink.train.loader import ContextWarmup, TokenWindows
from ultrathink.train.plan import Decided, Plan, PlanBook, RankProbes, apply_plan, plan_on_main, plan_run
from ultrathink.train.precision import keep_freed_host_memory, use_deterministic_kernels
from ultrathink.train.trainer import Deadline, Trainer, ready_model
from ultrathink.train.warm_start import (Parent, WarmStartError, check_optimizer, find_parent, load_parent_weights,
                                        open_model_config)

log = logging.getLogger(__name__)


def resolve_parent(ref: str, model_dir: Path) -> Parent:
    """train.init_from → the parent's local files. An alias is pinned to the version it names now, and that
    version is what the lineage records."""
    if is_mlflow_uri(ref):
        named = resolve_named_model(ref)
        return find_parent(named.files.model_dir, ref, lineage=named.pinned, tokenizer_dir=named.files.tokenizer_dir)
    if Path(ref).resolve() == model_dir.resolve() and not model_dir.exists():
        raise WarmStartError(f"train.init_from: {ref} is this stage's own output, which DVC removes before the "
                             "stage runs: warm start from the registry (models:/NAME@champion) or a checkpoint "
                             "(paths.checkpoint_dir/<fingerprint>/best or step_N)")
    return find_parent(Path(ref), ref)


def weights_fingerprint(params: Params, prepared: Path, plan: Plan, parent: Parent | None) -> Fingerprint:
    """What determines a pretrained model's weights: the params, the prepared data, the training code, the parent
    and the plan's decisions. It names the configuration's checkpoint folder and is recorded with the model."""
    return Fingerprint(training_params_hash(params.model, params.train), directory_hash(prepared),
                       code_hash(TRAINING_CODE), parent.weights_sha256 if parent else "none",
                       json_hash(plan.decisions()))


class Built(NamedTuple):
    trainer: Trainer
    parent: Parent | None
    decided: Decided
    resumed: int | None  # the step the trainer resumed at; None for a fresh start


def build_trainer(params: Params, dist: Distributed, log_metrics=None) -> Built:
    """The model (warm-started when train.init_from says so, after checking that the parent fits), its data and
    the checkpoint folder of exactly this configuration, trained as the plan says: the precision, attention kernel,
    compile, steps and (model.size auto) shape decided once per configuration and machine class and recorded in
    paths.train_plan (plan.py), so every run of this configuration on this class computes the same bits. The
    trainer comes resumed from the configuration's newest checkpoint where train.resume finds one."""
    p, cfg = params.paths, params.train
    prepared, tokenizer_dir = Path(p.prepared_dir), Path(p.tokenizer_dir)
    meta = read_meta(prepared)
    tokenizer_dir = tokenizer_dir if (tokenizer_dir / "tokenizer.json").is_file() else None
    tok_sha = meta.get("tokenizer_sha256") or (tokenizer_hash(tokenizer_dir) if tokenizer_dir else None)
    parent = resolve_parent(cfg.init_from, Path(p.model_dir)) if cfg.init_from else None
    model_base, vocab_size = params.model, meta["vocab_size"]
    if parent is not None and parent.open_model:  # continued pretraining: the parent's architecture
        model_base, vocab_size = open_model_config(parent, params.model, meta["vocab_size"])
    train_tokens, val_tokens = load_split(prepared, "train"), load_split(prepared, "val")
    probes = RankProbes(dist, vocab_size, train_tokens, val_tokens)  # a time budget probes on every rank
    decided = plan_on_main(dist, lambda: plan_run(model_base, cfg, vocab_size, train_tokens, val_tokens, dist.device,
                                                  dist.world_size, PlanBook(p.train_plan), probes.probe,
                                                  probes.side_by_side), probes)
    plan = decided.plan  # the other ranks follow it and, under a time budget, the main rank's revisions of it
    model_cfg, cfg = apply_plan(plan, model_base, cfg)
    checkpoints = CheckpointManager(p.checkpoint_dir, weights_fingerprint(params, prepared, plan, parent),
                                    cfg.keep_checkpoints, cfg.keep_configs,
                                    extra={"tokenizer_sha256": tok_sha, "optimizer": cfg.optimizer})
    latest = checkpoints.latest() if cfg.resume else None
    torch.manual_seed(cfg.seed)
    model = UltraThink(model_cfg, vocab_size)
    fresh = latest is None  # a resumed run's weights are the checkpoint's: none are read or drawn for it
    if parent is not None:
        if fresh:
            load_parent_weights(parent, model, tok_sha, tokenizer_dir)
        if cfg.init_optimizer:
            check_optimizer(parent, cfg.optimizer)
    elif cfg.embedding_init == "corpus" and fresh:
        init_from_corpus(model, train_tokens, cfg.seed)
    loader = TokenWindows(train_tokens, model_cfg.seq_len, cfg.batch_size, cfg.seed, rank=dist.rank,
                          world_size=dist.world_size, grad_accum=cfg.grad_accum)
    engine = build_engine(ready_model(model, cfg, plan.kernel, dist), cfg, dist)
    context = ContextWarmup(plan.seq_len_warmup_steps, model_cfg.seq_len) if plan.seq_len_warmup_steps else None
    trainer = Trainer(engine, loader, val_tokens, cfg, checkpoints, log_metrics, dist, peak_flops=decided.peak_flops,
                      deadline=deadline(params, decided, dist), context=context)
    return Built(trainer, parent, decided, trainer.resume_from(latest))


def deadline(params: Params, decided: Decided, dist: Distributed) -> Deadline | None:
    """The end of a time budget, for the run that measured its plan (a run that reads a recorded plan takes the
    recorded steps): the budget pays for the probe and the training loop (its validation passes and checkpoints),
    and what follows the last step (the weight average's validation pass, the temperature's pass and fit, saving
    the model), not for the stage's start-up."""
    plan = decided.plan
    if not decided.measured or not plan.budget or Budget.parse(plan.budget).kind != "seconds":
        return None
    book = PlanBook(params.paths.train_plan)

    def record(step: int, max_steps: int) -> None:
        plan.replans.append([step, max_steps])
        plan.max_steps = max_steps
        book.record(plan.machine, decided.key, plan)

    probe = plan.probe
    averaging = probe.validation_seconds if ema_horizon_for(params.train.ema_horizon, dist.backend) else 0.0
    # train.calibrate: its validation pass, and the fit on the logits kept (about as long again at the 2-minute
    # cells' shapes: benchmarks/README.md)
    calibrating = 2 * probe.eval_seconds if params.train.calibrate else 0.0
    return Deadline(Budget.parse(plan.budget).amount - probe.seconds, probe.save_seconds + averaging + calibrating,
                    probe.validation_seconds, probe.save_seconds * checkpoints_apart(params.train), record,
                    plan.step_ceiling)  # the other ranks' only make them follow rank 0


def pretrain(params: Params) -> None:
    cfg = params.train
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    keep_freed_host_memory()
    use_deterministic_kernels(cfg.deterministic)
    dist = setup(cfg.backend)
    try:
        trainer, parent, decided, resumed = build_trainer(params, dist)
        if dist.is_main:
            log.warning("%s", decided.describe())
        if resumed is None and parent is not None and cfg.init_optimizer:
            trainer.load_optimizer_from(parent.checkpoint)
        if dist.is_main:
            train_and_record(params, trainer, resumed, parent, decided)
        else:  # other ranks train in lockstep; the main rank alone talks to MLflow and writes files
            trainer.fit()
            trainer.prefer_average(trainer.select_weights())
            calibrate(trainer)
            trainer.full_weights()  # collective under FSDP and ZeRO-3: the main rank gathers the final weights
        dist.barrier()  # every rank is done, the main rank's files and MLflow run included
    except BaseException:
        dist.close()
        raise
    dist.finish()


def calibrate(trainer: Trainer) -> Calibration | None:
    """train.calibrate: the output's temperature fitted on the validation split to the weights the model holds
    now (every rank calls it), logged; None where it is off."""
    cfg = trainer.cfg
    if not cfg.calibrate:
        return None
    calibration = fit_temperature(trainer.model, trainer.val_data.eval_batches(cfg.batch_size, cfg.eval_batches),
                                  cfg.precision)
    if trainer.dist.is_main:
        log.warning("train.calibrate: the output's temperature %.4f takes the validation loss from %.4f to %.4f",
                    calibration.temperature, calibration.loss_before, calibration.loss_after)
    return calibration


# Per-step figures that depend on the machine's speed, not on the weights: kept in MLflow and in paths.train_run
# (the report card's throughput plot), left out of history.json.
TIMING_FIGURES = ("tokens_per_second", "mfu")


def train_and_record(params: Params, trainer: Trainer, resumed: int | None, parent: Parent | None,
                     decided: Decided) -> None:
    """Train under this configuration's MLflow run; write the model directory (weights and what the inputs
    determine: config, loss history, summary, lineage — so its hash in dvc.lock is reproduced by the same inputs)
    and, beside it, this run's facts (paths.train_run: run id, seconds, tokens/s), which change every run.
    MLflow is imported here, on the main rank alone: the other ranks never talk to it, and its import is 2-3 s of
    CPU that a rank would spend while the run waits for it."""
    import mlflow

    from ultrathink.registry.tracking import cleaning_metrics, flat_params, training_run

    p, plan = params.paths, decided.plan
    checkpoints = trainer.checkpoints
    with training_run(checkpoints.directory, bool(resumed), params.registry.experiment, params.train,
                      params.paths) as (run, sinks):
        trainer.log_metrics = sinks
        if not resumed:
            mlflow.log_params(flat_params(params))
            mlflow.set_tags({**lineage_tags(params), "fingerprint": checkpoints.fingerprint.id,
                             "plan_machine": plan.machine, "plan_measured": str(decided.measured).lower(),
                             "plan_other_classes": ", ".join(decided.others) or "none",
                             **(parent.tags() if parent else {})})
            mlflow.log_artifact(p.validate_report, "data")
            mlflow.log_artifact(str(Path(p.prepared_dir) / "meta.json"), "data")
            mlflow.log_artifacts(params.prepare.report_dir, "data/token_report")
            mlflow.log_metrics(cleaning_metrics(p.validate_report))
        model = trainer.model
        mlflow.log_metrics({"model_params": model.num_params(), "flops_per_token": model.flops_per_token()})
        result = trainer.fit()
        selected = trainer.select_weights()
        averaged = trainer.prefer_average(selected)
        calibration = calibrate(trainer)
        plan.max_steps = trainer.cfg.max_steps  # a time budget's run may have revised it
        mlflow.log_params(plan.mlflow_params())  # after training: with the steps it took
        history = [{k: v for k, v in point.items() if k not in TIMING_FIGURES} for point in result.history]
        summary = {"steps": result.step, "params": model.num_params(),
                   "final_train_loss": result.history[-1]["train_loss"],
                   "final_val_loss": result.history[-1].get("val_loss"), "best_val_loss": result.best_val_loss,
                   "skipped_steps": result.skipped_steps, "stopped_early": result.stopped_early,
                   "decay_began": result.decay_began,
                   "select": params.train.select, "selected_step": selected, "averaged": averaged,
                   "calibration": asdict(calibration) if calibration else None,
                   "plan": plan.summary(),
                   "world_size": trainer.dist.world_size, "backend": trainer.dist.backend}
        lineage = {"fingerprint": checkpoints.fingerprint.id, "parts": asdict(checkpoints.fingerprint),
                   "tokenizer_sha256": checkpoints.extra["tokenizer_sha256"], "machine": plan.machine,
                   "parent": parent.tags() if parent else None, "selected_step": selected, "averaged": averaged}
        mlflow.log_metrics({"train_seconds": result.seconds, "train_tokens_per_second": result.tokens_per_second})
        weights = trainer.full_weights()
        if calibration:
            mlflow.log_metrics({f"calibration_{k}": v for k, v in asdict(calibration).items()})
            weights = fold_temperature(weights, calibration.temperature)
        with atomic_dir(p.model_dir) as out:
            model.save_pretrained(out, weights)
            atomic_write_json(out / "history.json", history)
            atomic_write_json(out / "train_summary.json", summary)
            atomic_write_json(out / LINEAGE_FILE, lineage)
            model_sha = file_sha256(out / WEIGHTS_FILE)
        mlflow.set_tag("model_sha256", model_sha)
        facts = {"run_id": run.info.run_id, "model_sha256": model_sha, "seconds": round(result.seconds, 2),
                 "tokens_per_second": round(result.tokens_per_second, 1), "resumed_from": result.resumed_from,
                 "plan_measured": decided.measured, "machine": plan.machine,
                 "fingerprint": checkpoints.fingerprint.id}
        timings = [{"step": point["step"], **{k: point[k] for k in TIMING_FIGURES if k in point}}
                   for point in result.history if "tokens_per_second" in point]
        atomic_write_json(p.train_run, {**facts, "timings": timings})
    print(f"train: {json.dumps({**summary, **facts, 'plan': None})}")

