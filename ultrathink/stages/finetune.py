"""finetune: supervised fine-tuning of the pretrained model on prompt/response pairs (finetune.enabled).

Reads the pairs (finetune.data), gates them with their own Great Expectations suite, holds some out, trains LoRA
adapters (or every weight) on the answer tokens only, merges the adapters, and writes paths.finetuned_dir: model/
(plain UltraThink weights), tokenizer/ (the base tokenizer with the chat template), heldout.jsonl (the held-out
chats: promote_finetuned's yardstick) and finetune.json (what was done). The report (paths.finetune_report) has the
gate's results, the answer-only loss and bits per byte on the held-out chats before and after, and sample answers.
Off, the stage writes a finetune.json that says so (and an empty plan book, paths.finetune_plan, if there is none),
so the pipeline's DAG stays one for both."""

import time

from ultrathink.config import Params
from ultrathink.finetune.outputs import HELDOUT_FILE, STATUS_FILE
from ultrathink.io import atomic_dir, atomic_write_json, atomic_write_text
from ultrathink.post_training import record_off, run_post_training


def run(params: Params) -> None:
    p = params.paths
    if not params.finetune.enabled:
        record_off("finetune", p.finetuned_dir, STATUS_FILE, p.finetune_report, p.finetune_plan)
        return
    run_post_training("finetune", "fine-tune", params, fine_tune_on)


def fine_tune_on(dist, params: Params) -> None:
    import mlflow
    import torch

    from ultrathink.data.validation import CorpusValidationError, validate_pairs
    from ultrathink.model.chat import chat_tokenizer
    from ultrathink.finetune.lora import trainable_share
    from ultrathink.finetune.pairs import chats_jsonl, load_pairs, split_pairs
    from ultrathink.finetune.sft import build, resolve_base, sample_answers, score
    from ultrathink.lineage import git_commit
    from ultrathink.model import UltraThink
    from ultrathink.registry.tracking import flat_keys, save_run_id, training_run

    p, ft = params.paths, params.finetune
    started = time.perf_counter()
    pairs = load_pairs(ft)
    gate = validate_pairs(pairs, ft)
    if not gate.success:
        if dist.is_main:
            atomic_write_json(p.finetune_report, {"enabled": True, "gate": gate.to_dict()})
        raise CorpusValidationError(gate)
    train_chats, val_chats = split_pairs(pairs, ft.val_fraction)
    base = resolve_base(ft.init_from, params.registry.model_name) if dist.is_main else None
    pinned = dist.share(base.pinned if base else None)  # every rank reads the version the main rank pinned
    base = base or resolve_base(ft.init_from, params.registry.model_name, pinned=pinned)
    tokenizer = chat_tokenizer(base.tokenizer_dir)
    shown = val_chats[: ft.samples]
    if dist.is_main:  # the base model's answers, before training seeds its generators (the others wait in build)
        base_model = UltraThink.from_pretrained(base.model_dir, dist.device, torch.float32)
        before = score(base_model, tokenizer, val_chats)
        answers_before = sample_answers(base_model, tokenizer, shown, params)
        del base_model
    setup = build(params, base, tokenizer, train_chats, val_chats, dist)
    trainer = setup.trainer
    resumed = trainer.resume()
    if not dist.is_main:  # trains in lockstep with the main rank
        trainer.fit()
        trainer.select_weights()
        setup.final_model()  # collective under FSDP
        return
    trainable, total = trainable_share(trainer.model)
    with training_run(trainer.checkpoints.directory, bool(resumed), params.registry.experiment, params.train,
                      params.paths, run_name="finetune") as (run, sinks):
        trainer.log_metrics = sinks
        if not resumed:
            mlflow.log_params(flat_keys("finetune", params.finetune.model_dump()))
            mlflow.set_tags({"stage": "finetune", "git_commit": git_commit(), **base.tags(),
                             "fingerprint": trainer.checkpoints.fingerprint.id})
        result = trainer.fit()
        selected = trainer.select_weights()  # the best held-out pass's weights
        model = setup.final_model()
        after = score(model, tokenizer, val_chats)
        answers_after = sample_answers(model, tokenizer, shown, params)
        metrics = {"ft_response_loss_before": before.loss, "ft_response_loss": after.loss,
                   "ft_response_bpb_before": before.bits_per_byte, "ft_response_bpb": after.bits_per_byte,
                   "ft_trainable_params": float(trainable), "ft_trainable_share": trainable / total,
                   "ft_train_pairs": float(len(train_chats)), "ft_heldout_pairs": float(len(val_chats)),
                   "ft_train_seconds": result.seconds}
        if setup.quantized:  # the frozen base's adapted weights, fp32 vs quantized (finetune.quantize)
            metrics.update(ft_base_weight_bytes=float(setup.quantized[0]),
                           ft_base_quantized_bytes=float(setup.quantized[1]))
        mlflow.log_metrics(metrics)
        samples = [{"prompt": chat[-2]["content"], "reference": chat[-1]["content"], "before": b, "after": a}
                   for chat, b, a in zip(shown, answers_before, answers_after)]
        mlflow.log_dict(samples, "finetune/samples.json")
        status = {"enabled": True, "method": ft.method, "base": base.tags(), "steps": result.step,
                  "world_size": dist.world_size, "backend": dist.backend,
                  "selected_step": selected, "resumed_from": result.resumed_from,
                  "fingerprint": trainer.checkpoints.fingerprint.id, "metrics": metrics}
        with atomic_dir(p.finetuned_dir) as out:
            model.save_pretrained(out / "model")
            tokenizer.save_pretrained(out / "tokenizer")
            atomic_write_json(out / "model" / "history.json", result.history)
            atomic_write_text(out / HELDOUT_FILE, chats_jsonl(val_chats))
            atomic_write_json(out / STATUS_FILE, status)
            save_run_id(out, run.info.run_id)
    report = {"enabled": True, **metrics, "mlflow_run_id": run.info.run_id, "base_model": base.pinned,
              "seconds": round(time.perf_counter() - started, 2), "gate": gate.to_dict(), "samples": samples}
    atomic_write_json(p.finetune_report, report)
    quantized = (f", base {ft.quantize}: adapted weights {setup.quantized[0] / 2**20:.3g} → "
                 f"{setup.quantized[1] / 2**20:.3g} MiB" if setup.quantized else "")
    print(f"finetune: {ft.method}{quantized} on {len(train_chats)} pairs from {base.pinned}, {result.step} steps "
          f"({trainable:,} of {total:,} weights trained, {trainable / total:.2%}); held-out answers: loss "
          f"{before.loss:.4f} → {after.loss:.4f}, bits/byte {before.bits_per_byte:.4f} → {after.bits_per_byte:.4f}")
    for s in samples:
        print(f"  Q {s['prompt']!r}\n    before {s['before'][:120]!r}\n    after  {s['after'][:120]!r}")

