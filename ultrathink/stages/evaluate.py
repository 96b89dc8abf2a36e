"""evaluate: held-out loss, perplexity and bits per byte (the one yardstick of ultrathink.evaluate, on every val
document or the first evaluate.max_val_bytes of them) against the unigram baseline, sample generations, and the loss
curves as DVC plots; the metrics also go to the model's MLflow run, whose id metrics.json carries."""

import csv
import io
import json
from pathlib import Path

import mlflow

from ultrathink.config import Params
from ultrathink.data.packing import val_documents
from ultrathink.data.tokens import load_split, read_meta
from ultrathink.evaluate import (Yardstick, bits_per_byte, encode_documents, sample_generations, score_stream,
                                 unigram_cross_entropy)
from ultrathink.device import resolve_device
from ultrathink.io import atomic_write_json, atomic_write_text
from ultrathink.model import UltraThink
from ultrathink.registry.tracking import run_of_model, start_or_resume_run
from ultrathink.tokenizer import load_tokenizer


def curve_csv(history: list[dict], key: str) -> str:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["step", key])
    writer.writerows([row["step"], row[key]] for row in history if key in row)
    return out.getvalue()


def run(params: Params) -> None:
    p, cfg = params.paths, params.evaluate
    model_dir, prepared = Path(p.model_dir), Path(p.prepared_dir)
    # On the GPU when there is one: the device promote re-scores the champion on (text_eval.score_model's auto).
    model = UltraThink.from_pretrained(model_dir, device=resolve_device())
    tokenizer = load_tokenizer(p.tokenizer_dir)
    meta = read_meta(prepared)
    yardstick = Yardstick(tuple(val_documents(prepared, cfg.max_val_bytes)))
    stream = encode_documents(tokenizer, yardstick.documents)
    score = score_stream(model, stream, yardstick.bytes, len(yardstick.documents), cfg.batch_size)
    unigram = unigram_cross_entropy(load_split(prepared, "train"), stream[1:].numpy(), meta["vocab_size"])
    metrics = {"val_loss": score.loss, "val_perplexity": score.perplexity, "val_bpb": score.bits_per_byte,
               "val_tokens_scored": float(score.tokens), "val_bytes_scored": float(score.bytes),
               "val_documents_scored": float(score.documents), "unigram_loss": unigram,
               "unigram_bpb": bits_per_byte(unigram, score.tokens, score.bytes)}
    samples = sample_generations(model, tokenizer, cfg)
    history = json.loads((model_dir / "history.json").read_text())

    with start_or_resume_run(params.registry.experiment, Path("."),
                             run_of_model(model_dir, Path(p.train_run), params.registry.experiment, Path("."))) as run:
        mlflow.log_metrics(metrics)
        mlflow.log_dict(samples, "eval/samples.json")
    atomic_write_json(p.metrics, {**metrics,
                                  "yardstick_sha256": yardstick.sha256, "mlflow_run_id": run.info.run_id})
    atomic_write_json(p.samples, samples)
    atomic_write_text(p.loss_curve, curve_csv(history, "train_loss"))
    atomic_write_text(p.val_curve, curve_csv(history, "val_loss"))
    print(f"evaluate: val_loss {score.loss:.4f} (unigram {unigram:.4f}) ppl {score.perplexity:.1f} "
          f"bpb {score.bits_per_byte:.4f} over {score.tokens:,} tokens, {score.bytes:,} bytes, "
          f"{score.documents:,} documents")
    for s in samples:
        print(f"  {s['prompt']!r} → greedy {s['greedy'][:100]!r} | sampled {s['sampled'][:100]!r}")

