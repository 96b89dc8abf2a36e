"""train: pretrain the UltraThink decoder on the packed tokens; write the final weights (and keep resumable
checkpoints). One MLflow run per trained model carries its params, per-step curves and lineage."""

import json
import logging
import os
import sys
from dataclasses import asdict
from pathlib import Path

import mlflow
import torch

from ultrathink.cli import stage_entry
from ultrathink.config import Params
from ultrathink.data.packing import load_split, read_meta
from ultrathink.io import atomic_dir, atomic_write_json
from ultrathink.lineage import code_hash, directory_hash, lineage_tags
from ultrathink.model import UltraThink
from ultrathink.registry.tracking import (MetricSinks, StepMetrics, TensorBoardScalars, load_run_id, pin_model_uri,
                                         save_run_id, start_or_resume_run)
from ultrathink.text_eval import is_mlflow_uri, resolve_model
from ultrathink.tokenizer import tokenizer_hash
from ultrathink.train.budget import Plan, apply_plan, make_plan
from ultrathink.train.checkpoint import CheckpointManager, Fingerprint
from ultrathink.train.distributed import Distributed, setup
from ultrathink.train.loader import TokenWindows
from ultrathink.train.sizing import Sizing
from ultrathink.train.precision import keep_freed_host_memory
from ultrathink.train.trainer import Trainer
from ultrathink.train.warm_start import (LINEAGE_FILE, Parent, WarmStartError, check_optimizer, find_parent,
                                        load_parent_weights)


log = logging.getLogger(__name__)

def flatten(prefix: str, value) -> dict[str, object]:
    """{'a': {'b': 1}} → {'prefix.a.b': 1}: MLflow keys for nested sections and reports."""
    if isinstance(value, dict):
        return {k: v for key, sub in value.items() for k, v in flatten(f"{prefix}.{key}", sub).items()}
    return {prefix: value}


def flat_params(params: Params) -> dict[str, object]:
    dump = params.model_dump(by_alias=True)
    return {k: v for section in ("data", "tokenizer", "model", "train") for k, v in flatten(section, dump[section]).items()}


def cleaning_metrics(validate_report: str) -> dict[str, float]:
    """The validate stage's counts (documents dropped per cleaning step, matches per constitution principle)."""
    cleaning = json.loads(Path(validate_report).read_text()).get("cleaning", {})
    return {k: float(v) for k, v in flatten("cleaning", cleaning).items() if isinstance(v, (int, float))}


def resolve_parent(ref: str, model_dir: Path) -> Parent:
    """train.init_from → the parent's local files. An alias is pinned to the version it names now, and that
    version is what the lineage records."""
    if is_mlflow_uri(ref):
        pinned = pin_model_uri(ref, Path("."))
        parent_dir, tokenizer_dir = resolve_model(pinned)
        return find_parent(parent_dir, ref, lineage=pinned, tokenizer_dir=tokenizer_dir)
    if Path(ref).resolve() == model_dir.resolve() and not model_dir.exists():
        raise WarmStartError(f"train.init_from: {ref} is this stage's own output, which DVC removes before the "
                             "stage runs: warm start from the registry (models:/NAME@champion) or a checkpoint "
                             "(paths.checkpoint_dir/<fingerprint>/best or step_N)")
    return find_parent(Path(ref), ref)


def build_trainer(params: Params, dist: Distributed, log_metrics=None) -> tuple[Trainer, Parent | None, Plan]:
    """The model (warm-started when train.init_from says so, after checking that the parent fits), its data and
    the checkpoint folder of exactly this configuration; the plan that says how many steps (train.budget) and, under
    model.size auto, what shape — recorded in that folder, so a resumed run takes the same plan."""
    p, cfg = params.paths, params.train
    prepared, tokenizer_dir = Path(p.prepared_dir), Path(p.tokenizer_dir)
    meta = read_meta(prepared)
    tokenizer_dir = tokenizer_dir if (tokenizer_dir / "tokenizer.json").is_file() else None
    tok_sha = meta.get("tokenizer_sha256") or (tokenizer_hash(tokenizer_dir) if tokenizer_dir else None)
    parent = resolve_parent(cfg.init_from, Path(p.model_dir)) if cfg.init_from else None
    train_tokens, val_tokens = load_split(prepared, "train"), load_split(prepared, "val")
    fingerprint = Fingerprint(cfg.fingerprint_params(params.model), directory_hash(prepared), code_hash(),
                              parent.weights_sha256 if parent else "none")
    checkpoints = CheckpointManager(p.checkpoint_dir, fingerprint, cfg.keep_checkpoints, cfg.keep_configs,
                                    extra={"tokenizer_sha256": tok_sha, "optimizer": cfg.optimizer})
    plan = Plan.load(checkpoints.directory) if cfg.resume else None
    if plan is None and dist.is_main:
        plan = make_plan(params.model, cfg, meta["vocab_size"], train_tokens, val_tokens, dist.device,
                         dist.world_size)[0]
    plan = Plan.from_dict(dist.share(plan.to_dict() if dist.is_main else None))
    model_cfg, cfg = apply_plan(plan, params.model, cfg)
    torch.manual_seed(cfg.seed)
    model = UltraThink(model_cfg, meta["vocab_size"])
    if parent is not None:
        load_parent_weights(parent, model, tok_sha, tokenizer_dir)
        if cfg.init_optimizer:
            check_optimizer(parent, cfg.optimizer)
    loader = TokenWindows(train_tokens, model_cfg.seq_len, cfg.batch_size, cfg.seed,
                          rank=dist.rank, world_size=dist.world_size)
    return Trainer(model, loader, val_tokens, cfg, checkpoints, log_metrics, dist), parent, plan


def run(params: Params) -> None:
    cfg = params.train
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    keep_freed_host_memory()
    dist = setup(cfg.backend)
    try:
        trainer, parent, plan = build_trainer(params, dist)
        resumed = trainer.resume()
        if dist.is_main:
            plan.save(trainer.checkpoints.directory)  # after resume(), which may set an old folder aside
            if plan.sizing or plan.budget:
                log.warning("%s", describe(plan))
        if resumed is None and parent is not None and cfg.init_optimizer:
            trainer.load_optimizer_from(parent.checkpoint)
        if dist.is_main:
            train_and_record(params, trainer, resumed, parent, plan)
        else:  # other ranks train in lockstep; the main rank alone talks to MLflow and writes files
            trainer.fit()
            trainer.full_weights()  # collective under FSDP and ZeRO-3: the main rank gathers the final weights
        dist.barrier()  # every rank is done, the main rank's files and MLflow run included
    except BaseException:
        dist.close()
        raise
    if dist.world_size > 1:
        leave_at_once()
    dist.close()


def leave_at_once() -> None:
    """End a worker of a multi-process run once every rank has finished. Tearing down the process groups
    (DeepSpeed's included) and the interpreter aborted a ZeRO-3 worker now and then ("terminate called without an
    active exception", about 1 run in 4 here), failing a run whose outputs were complete; the operating system
    releases the sockets and memory as well."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def metric_sinks(params: Params, run_id: str) -> MetricSinks:
    """Every step's metrics to the MLflow run (in batches), and to TensorBoard when train.tensorboard is on."""
    sinks = [StepMetrics(params.train.log_every)]
    if params.train.tensorboard:
        sinks.append(TensorBoardScalars(Path(params.paths.tensorboard_dir) / run_id))
    return MetricSinks(*sinks)


def describe(plan: Plan) -> str:
    """One line on what the budget bought (and, under model.size auto, the shape chosen and why)."""
    line = f"plan: {plan.max_steps} steps ({plan.max_steps * plan.tokens_per_step:,} tokens)"
    if plan.budget:
        line += f" for budget {plan.budget}"
    if plan.probe:
        line += (f", at {plan.probe.step_seconds * 1e3:.0f} ms/step measured (probe {plan.probe.seconds:.1f} s, "
                 f"validation {plan.probe.eval_seconds:.2f} s)")
    if plan.sizing:
        line += "; " + Sizing.from_dict(plan.sizing).explain()
    return line


def train_and_record(params: Params, trainer: Trainer, resumed: int | None, parent: Parent | None,
                     plan: Plan) -> None:
    p = params.paths
    checkpoints = trainer.checkpoints
    run_id = load_run_id(checkpoints.directory) if resumed else None
    with start_or_resume_run(params.registry.experiment, Path("."), run_id) as run:
        save_run_id(checkpoints.directory, run.info.run_id)
        trainer.log_metrics = metric_sinks(params, run.info.run_id)
        if not resumed:
            mlflow.log_params(flat_params(params))
            mlflow.log_params({**plan.mlflow_params(), **{f"plan.model.{k}": v for k, v in
                                                           plan.sizing.get("shape", {}).items()},
                               **({"plan.batch_size": plan.sizing["batch_size"]} if plan.sizing else {})})
            mlflow.set_tags({**lineage_tags(params), "fingerprint": checkpoints.fingerprint.id,
                             **(parent.tags() if parent else {})})
            mlflow.log_artifact(p.validate_report, "data")
            mlflow.log_artifact(str(Path(p.prepared_dir) / "meta.json"), "data")
            mlflow.log_artifacts(params.prepare.report_dir, "data/token_report")
            mlflow.log_metrics(cleaning_metrics(p.validate_report))
        model = trainer.model
        mlflow.log_metrics({"model_params": model.num_params(), "flops_per_token": model.flops_per_token()})
        try:
            result = trainer.fit()
        finally:
            trainer.log_metrics.flush()  # the steps since the last batch of points
        summary = {"steps": result.step, "resumed_from": result.resumed_from, "seconds": round(result.seconds, 2),
                   "tokens_per_second": round(result.tokens_per_second, 1), "params": model.num_params(),
                   "final_train_loss": result.history[-1]["train_loss"], "final_val_loss": result.history[-1].get("val_loss"),
                   "best_val_loss": result.best_val_loss, "skipped_steps": result.skipped_steps,
                   "stopped_early": result.stopped_early, "select": params.train.select,
                   "selected_step": result.selected_step, "plan": plan.to_dict()}
        lineage = {"fingerprint": checkpoints.fingerprint.id, "parts": asdict(checkpoints.fingerprint),
                   "tokenizer_sha256": checkpoints.extra["tokenizer_sha256"],
                   "parent": parent.tags() if parent else None, "selected_step": result.selected_step}
        mlflow.log_metrics({"train_seconds": result.seconds, "train_tokens_per_second": result.tokens_per_second})
        weights = trainer.full_weights()
        with atomic_dir(p.model_dir) as out:
            model.save_pretrained(out, weights)
            atomic_write_json(out / "history.json", result.history)
            atomic_write_json(out / "train_summary.json", summary)
            atomic_write_json(out / LINEAGE_FILE, lineage)
            save_run_id(out, run.info.run_id)
    print(f"train: {json.dumps(summary)}")


if __name__ == "__main__":
    stage_entry("train")
