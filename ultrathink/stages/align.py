"""align: preference alignment of the fine-tuned model on (prompt, chosen, rejected) pairs (align.enabled).

Reads the pairs (align.data), gates them with their own Great Expectations suite, holds some out, computes the
reference's log-probabilities of every answer once (the model as it starts: the frozen reference DPO needs), trains
LoRA adapters (or every weight) on the preference loss (align.loss), merges the adapters and writes
paths.aligned_dir: model/, tokenizer/, heldout.jsonl (the held-out pairs: promote_aligned's yardstick) and align.json
(what was done). The report (paths.align_report) has the gate's results; on the held-out pairs, before and after:
how often the model's own likelihood prefers the chosen answer (and the preference loss the promotion compares),
the implicit rewards' accuracy and margin against the reference after, the chosen answers' loss; and sample
answers. Off, the stage writes an align.json that says so (and an empty plan book, paths.align_plan, if there is
none), so the pipeline's DAG stays one for both."""

import time

from ultrathink.align.outputs import HELDOUT_FILE, STATUS_FILE
from ultrathink.config import Params
from ultrathink.io import atomic_dir, atomic_write_json, atomic_write_text
from ultrathink.post_training import record_off, run_post_training


def run(params: Params) -> None:
    p = params.paths
    if not params.align.enabled:
        record_off("align", p.aligned_dir, STATUS_FILE, p.align_report, p.align_plan)
        return
    run_post_training("align", "alignment", params, align_on)


def align_on(dist, params: Params) -> None:
    import mlflow
    import torch

    from ultrathink.align.dpo import preference_loss
    from ultrathink.align.preferences import load_preferences, pairs_jsonl, split_preferences
    from ultrathink.align.train import build
    from ultrathink.data.validation import CorpusValidationError, validate_preferences
    from ultrathink.finetune.lora import trainable_share
    from ultrathink.finetune.sft import resolve_base, sample_answers
    from ultrathink.lineage import git_commit
    from ultrathink.model import UltraThink
    from ultrathink.model.chat import chat_tokenizer
    from ultrathink.registry.tracking import flat_keys, save_run_id, training_run
    from ultrathink.scoring import pair_chats, pair_logprobs, score_conversations, score_preferences

    p, al = params.paths, params.align
    started = time.perf_counter()
    pairs = load_preferences(al)
    gate = validate_preferences(pairs, al)
    if not gate.success:
        if dist.is_main:
            atomic_write_json(p.align_report, {"enabled": True, "gate": gate.to_dict()})
        raise CorpusValidationError(gate)
    train_pairs, val_pairs = split_preferences(pairs, al.val_fraction)
    base = resolve_base(al.init_from, params.registry.finetuned_name) if dist.is_main else None
    pinned = dist.share(base.pinned if base else None)  # every rank reads the version the main rank pinned
    base = base or resolve_base(al.init_from, params.registry.finetuned_name, pinned=pinned)
    tokenizer = chat_tokenizer(base.tokenizer_dir)
    chosen_chats = pair_chats(val_pairs)[0]
    prompts = chosen_chats[: al.samples]  # sample_answers answers the turns before each chat's last answer
    if dist.is_main:  # the base model's figures, before training seeds its generators (the others wait in build)
        base_model = UltraThink.from_pretrained(base.model_dir, dist.device, torch.float32)
        before = score_preferences(base_model, tokenizer, val_pairs)
        chosen_before = score_conversations(base_model, tokenizer, chosen_chats)
        answers_before = sample_answers(base_model, tokenizer, prompts, params)
        del base_model
    setup, val_reference = build(params, base, tokenizer, train_pairs, val_pairs, dist)
    trainer = setup.trainer
    resumed = trainer.resume()
    if not dist.is_main:  # trains in lockstep with the main rank
        trainer.fit()
        trainer.select_weights()
        setup.final_model()  # collective under FSDP
        return
    trainable, total = trainable_share(trainer.model)
    with training_run(trainer.checkpoints.directory, bool(resumed), params.registry.experiment, params.train,
                      params.paths, run_name="align") as (run, sinks):
        trainer.log_metrics = sinks
        if not resumed:
            mlflow.log_params(flat_keys("align", al.model_dump()))
            mlflow.set_tags({"stage": "align", "git_commit": git_commit(), **base.tags(),
                             "data_hash": trainer.checkpoints.fingerprint.data,
                             "fingerprint": trainer.checkpoints.fingerprint.id})
        result = trainer.fit()
        selected = trainer.select_weights()  # the best held-out pass's weights
        model = setup.final_model()
        after = score_preferences(model, tokenizer, val_pairs)
        chosen_after = score_conversations(model, tokenizer, chosen_chats)
        rewards = preference_loss(*pair_logprobs(model, tokenizer, val_pairs), *val_reference, al.beta, al.loss)
        answers_after = sample_answers(model, tokenizer, prompts, params)
        metrics = {
            "align_preference_bits_before": before.loss_bits, "align_preference_bits": after.loss_bits,
            "align_likelihood_accuracy_before": before.accuracy, "align_likelihood_accuracy": after.accuracy,
            "align_likelihood_margin_before": before.margin, "align_likelihood_margin": after.margin,
            "align_reward_accuracy": float((rewards.margins > 0).double().mean()),
            "align_reward_margin": float(rewards.margins.mean()),
            "align_chosen_reward": float(rewards.chosen_rewards.mean()),
            "align_rejected_reward": float(rewards.rejected_rewards.mean()),
            "align_chosen_loss_before": chosen_before.loss, "align_chosen_loss": chosen_after.loss,
            "align_trainable_params": float(trainable), "align_trainable_share": trainable / total,
            "align_train_pairs": float(len(train_pairs)), "align_heldout_pairs": float(len(val_pairs)),
            "align_train_seconds": result.seconds}
        mlflow.log_metrics(metrics)
        samples = [{"prompt": pair["prompt"][-1]["content"], "chosen": pair["chosen"], "rejected": pair["rejected"],
                    "before": b, "after": a} for pair, b, a in zip(val_pairs, answers_before, answers_after)]
        mlflow.log_dict(samples, "align/samples.json")
        status = {"enabled": True, "method": al.method, "loss": al.loss, "beta": al.beta, "base": base.tags(),
                  "data_hash": trainer.checkpoints.fingerprint.data, "steps": result.step,
                  "world_size": dist.world_size, "backend": dist.backend, "selected_step": selected,
                  "resumed_from": result.resumed_from, "fingerprint": trainer.checkpoints.fingerprint.id,
                  "metrics": metrics}
        with atomic_dir(p.aligned_dir) as out:
            model.save_pretrained(out / "model")
            tokenizer.save_pretrained(out / "tokenizer")
            atomic_write_json(out / "model" / "history.json", result.history)
            atomic_write_text(out / HELDOUT_FILE, pairs_jsonl(val_pairs))
            atomic_write_json(out / STATUS_FILE, status)
            save_run_id(out, run.info.run_id)
    report = {"enabled": True, **metrics, "mlflow_run_id": run.info.run_id, "base_model": base.pinned,
              "seconds": round(time.perf_counter() - started, 2), "gate": gate.to_dict(), "samples": samples}
    atomic_write_json(p.align_report, report)
    print(f"align: {al.loss} (β {al.beta}, {al.method}) on {len(train_pairs)} pairs from {base.pinned}, "
          f"{result.step} steps ({trainable:,} of {total:,} weights trained, {trainable / total:.2%}); held-out "
          f"pairs: likelihood prefers the chosen answer {before.accuracy:.1%} → {after.accuracy:.1%}, implicit "
          f"reward accuracy {metrics['align_reward_accuracy']:.1%} (margin {metrics['align_reward_margin']:.3f}), "
          f"chosen answers' loss {chosen_before.loss:.4f} → {chosen_after.loss:.4f}")
    for s in samples:
        print(f"  Q {s['prompt']!r}\n    before {s['before'][:120]!r}\n    after  {s['after'][:120]!r}")

