"""evaluate: held-out loss, perplexity and bits per byte against the unigram baseline, sample generations, and the
loss curves as DVC plots; the metrics also go to the model's MLflow run."""

import csv
import io
import json
from pathlib import Path

import mlflow

from ultrathink.cli import stage_entry
from ultrathink.config import Params
from ultrathink.data.packing import load_split, read_meta
from ultrathink.evaluate import bits_per_byte, evaluate_split, sample_generations, unigram_cross_entropy
from ultrathink.io import atomic_write_json, atomic_write_text
from ultrathink.model import UltraThink
from ultrathink.registry.tracking import load_run_id, start_or_resume_run
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
    model = UltraThink.from_pretrained(model_dir)
    meta = read_meta(prepared)
    val = load_split(prepared, "val")
    metrics = evaluate_split(model, val, meta["val"], cfg)
    unigram = unigram_cross_entropy(load_split(prepared, "train"), val, meta["vocab_size"])
    metrics |= {"unigram_loss": unigram, "unigram_bpb": bits_per_byte(unigram, meta["val"]["tokens"], meta["val"]["bytes"])}
    samples = sample_generations(model, load_tokenizer(p.tokenizer_dir), cfg)
    history = json.loads((model_dir / "history.json").read_text())

    atomic_write_json(p.metrics, {k: round(v, 6) for k, v in metrics.items()})
    atomic_write_json(p.samples, samples)
    atomic_write_text(p.loss_curve, curve_csv(history, "train_loss"))
    atomic_write_text(p.val_curve, curve_csv(history, "val_loss"))
    with start_or_resume_run(params.registry.experiment, Path("."), load_run_id(model_dir)):
        mlflow.log_metrics(metrics)
        mlflow.log_dict(samples, "eval/samples.json")
    print(f"evaluate: val_loss {metrics['val_loss']:.4f} (unigram {unigram:.4f}) ppl {metrics['val_perplexity']:.1f} "
          f"bpb {metrics['val_bpb']:.4f}")
    for s in samples:
        print(f"  {s['prompt']!r} → greedy {s['greedy'][:100]!r} | sampled {s['sampled'][:100]!r}")


if __name__ == "__main__":
    stage_entry("evaluate")
