"""A run's report card: one Markdown page (the model, its data and plan, its scores against the unigram baseline and
on downstream tasks, sample generations) and PNG plots of its training curves, which the evaluate stage writes and
logs to the model's MLflow run.

Plots are drawn on `matplotlib.figure.Figure` objects with the Agg canvas, never through pyplot, so no global state
(backend, current figure) changes in the caller. They are saved without matplotlib's Software stamp so the same
inputs give the same bytes (on the same matplotlib and FreeType), and the x axis is always tokens seen
(step × the plan's tokens per step), which compares runs of different batch sizes."""

from __future__ import annotations

import io
import json
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import EngFormatter, PercentFormatter

from ultrathink.io import atomic_write_bytes

FIGSIZE = (7.0, 4.0)  # inches; at DPI 100 every PNG is 700 × 400 pixels
DPI = 100
TITLES = {"loss": "Loss", "lr": "Learning rate", "grad_norm": "Gradient norm", "throughput": "Throughput",
          "moe": "MoE routing health", "dre": "DRE (mixture-of-depths) routing"}  # by PNG file stem

# The val metrics the table has rows for, each with the amount it averages over: bits per byte over bytes, loss and
# perplexity over tokens. These, the unigram baseline and the amounts scored are not repeated as rows of their own.
VAL_ROWS = {"val_bpb": ("val bits per byte", "val_bytes_scored"),
            "val_loss": ("val loss (nats/token)", "val_tokens_scored"),
            "val_perplexity": ("val perplexity", "val_tokens_scored")}
SHOWN = {*VAL_ROWS, "val_bytes_scored", "val_tokens_scored", "val_documents_scored", "unigram_bpb", "unigram_loss"}


def write_report_card(*, markdown: Path, plots_dir: Path, model_dir: Path, metrics: dict[str, Any],
                      tasks: dict[str, dict], samples: Sequence[dict[str, str]], train_run: dict[str, Any],
                      data: dict[str, dict | None]) -> list[Path]:
    """Write the report card: the PNG plots into `plots_dir` (removing PNGs there that an earlier run wrote and
    this one does not, e.g. moe.png after MoE was turned off), then `markdown`, which links them relative to its
    own folder. Returns the Markdown file and every PNG written, for the caller to log."""
    markdown, plots_dir, model_dir = Path(markdown), Path(plots_dir), Path(model_dir)
    config = _read_json(model_dir / "config.json")
    history = _read_json(model_dir / "history.json")
    summary = _read_json(model_dir / "train_summary.json")
    lineage = _read_json(model_dir / "lineage.json") if (model_dir / "lineage.json").is_file() else {}
    tokens_per_step = summary.get("plan", {}).get("tokens_per_step")

    pngs = {}
    for name, figure in _figures(history, tokens_per_step, metrics, train_run.get("timings")).items():
        pngs[name] = plots_dir / f"{name}.png"
        atomic_write_bytes(pngs[name], _png(figure))
    for stale in set(plots_dir.glob("*.png")) - set(pngs.values()):
        stale.unlink()

    links = {TITLES[name]: Path(os.path.relpath(path, markdown.parent)).as_posix()
             for name, path in pngs.items()}
    sections = [_title(summary, train_run, tokens_per_step), _model_section(config, summary, lineage),
                _data_section(data, summary.get("plan", {})), _metrics_section(metrics, tasks),
                _samples_section(samples), _plots_section(links)]
    atomic_write_bytes(markdown, ("\n\n".join(sections) + "\n").encode())
    return [markdown, *pngs.values()]


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text())


# ---------------------------------------------------------------------------------------------------------- plots

def _figures(history: list[dict], tokens_per_step: int | None, metrics: dict[str, Any],
          timings: list[dict] | None) -> dict[str, Figure]:
    """The figures this run has data for, by file stem: the routing plots only when history has their keys, the
    throughput plot only when the train stage recorded timings (older runs did not)."""
    x = Tokens(tokens_per_step)
    figures = {"loss": _loss_figure(history, x, metrics.get("unigram_loss")),
               "lr": _line_figure("lr", history, x, "learning rate"),
               "grad_norm": _grad_norm_figure(history, x)}
    if timings:
        figures["throughput"] = _throughput_figure(timings, x)
    if any("moe_entropy" in row for row in history):
        figures["moe"] = _moe_figure(history, x)
    if any("dre_kept" in row for row in history):
        figures["dre"] = _dre_figure(history, x)
    return figures


def _png(figure: Figure) -> bytes:
    buffer = io.BytesIO()
    FigureCanvasAgg(figure)  # attaches itself to the figure: Agg rendering without pyplot's backend switch
    figure.savefig(buffer, format="png", dpi=DPI, metadata={"Software": None})
    return buffer.getvalue()


class Tokens:
    """The x axis: tokens seen at a step (steps, when an older summary lacks the plan's tokens per step)."""

    def __init__(self, tokens_per_step: int | None):
        self.per_step = tokens_per_step or 1
        self.label = "tokens seen" if tokens_per_step else "step"

    def series(self, rows: Sequence[dict], key: str) -> tuple[list[float], list[float]]:
        points = [(row["step"] * self.per_step, row[key]) for row in rows if _is_number(row.get(key))]
        return [p[0] for p in points], [p[1] for p in points]


def _axes(name: str, x: Tokens, ylabel: str) -> tuple[Figure, Axes]:
    figure = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    ax = figure.add_subplot()
    ax.set_title(TITLES[name])
    ax.set_xlabel(x.label)
    ax.set_ylabel(ylabel)
    ax.xaxis.set_major_formatter(EngFormatter(sep=""))  # 200k, 1.5M: token counts read at a glance
    ax.grid(alpha=0.3)
    return figure, ax


def _line_figure(key: str, history: list[dict], x: Tokens, ylabel: str) -> Figure:
    figure, ax = _axes(key, x, ylabel)
    ax.plot(*x.series(history, key))
    return figure


def _loss_figure(history: list[dict], x: Tokens, unigram_loss: float | None) -> Figure:
    figure, ax = _axes("loss", x, "loss (nats/token)")
    ax.plot(*x.series(history, "train_loss"), label="train")
    val = x.series(history, "val_loss")
    if val[0]:  # a run may log no validation (an empty line would still get a legend entry)
        ax.plot(*val, marker="o", markersize=4, label="val")
    if _is_number(unigram_loss):
        ax.axhline(unigram_loss, linestyle="--", color="gray", label="unigram baseline (val)")
    ax.legend()
    return figure


def _grad_norm_figure(history: list[dict], x: Tokens) -> Figure:
    figure = _line_figure("grad_norm", history, x, "gradient norm (before clipping)")
    norms = [v for v in x.series(history, "grad_norm")[1] if v > 0]
    if norms and max(norms) / min(norms) > 100:  # over two decades a linear axis flattens all but the spikes
        figure.axes[0].set_yscale("log")
    return figure


def _throughput_figure(timings: list[dict], x: Tokens) -> Figure:
    figure, ax = _axes("throughput", x, "tokens / second")
    ax.yaxis.set_major_formatter(EngFormatter(sep=""))
    speed = x.series(timings, "tokens_per_second")
    ax.plot(*speed, color="C0", label="tokens/s")
    _from_zero(ax, speed[1])
    ratios = [t["mfu"] / t["tokens_per_second"] for t in timings if t.get("mfu") and t.get("tokens_per_second")]
    if ratios:  # MFU is tokens/s times a constant (FLOPs per token / peak): a second scale, not a second line
        per_token = sum(ratios) / len(ratios)
        right = ax.secondary_yaxis("right", functions=(lambda v: v * per_token, lambda v: v / per_token))
        right.set_ylabel("MFU (model FLOPs utilization)")
        right.yaxis.set_major_formatter(PercentFormatter(xmax=1, decimals=0))
    return figure


def _from_zero(ax: Axes, values: list[float]) -> None:
    """A y axis from zero (a few percent of jitter should look like a few percent), with headroom at the top."""
    ax.set_ylim(0, 1.15 * max(values, default=1) or 1)


def _moe_figure(history: list[dict], x: Tokens) -> Figure:
    return _routing_figure(history, x, "moe", "share (0 to 1)", {"moe_entropy": "load entropy (1 = even)",
                           "moe_max_expert_share": "busiest expert's share"}, "entropy")


def _dre_figure(history: list[dict], x: Tokens) -> Figure:
    return _routing_figure(history, x, "dre", "fraction of dense (0 to 1)", {"dre_kept": "tokens kept",
                           "dre_flops_ratio": "FLOPs per token"}, "kept")


def _routing_figure(history: list[dict], x: Tokens, variant: str, ylabel: str, overall: dict[str, str],
                    per_layer: str) -> Figure:
    """A routing variant's health: its overall figures (bold) and one per-layer figure (thin), as shares."""
    figure, ax = _axes(variant, x, ylabel)
    for key, label in overall.items():
        ax.plot(*x.series(history, key), linewidth=2, label=label)
    _per_layer(ax, history, x, variant, per_layer)
    _finish_shares(figure, ax)
    return figure


def _per_layer(ax: Axes, history: list[dict], x: Tokens, variant: str, figure_name: str) -> None:
    """Thin lines for one per-layer figure ('moe/layer3/entropy'), layers in numeric order."""
    pattern = re.compile(rf"{variant}/layer(\d+)/{figure_name}")
    layers = sorted({int(m[1]) for row in history for key in row if (m := pattern.fullmatch(key))})
    for layer in layers:
        ax.plot(*x.series(history, f"{variant}/layer{layer}/{figure_name}"), linewidth=0.8, alpha=0.7,
                label=f"layer {layer} {figure_name}")


def _finish_shares(figure: Figure, ax: Axes) -> None:
    """Shares get at least the whole 0 to 1 range, so two runs' plots compare at a glance; the legend goes right of
    the axes, where the per-layer lines cannot cover it."""
    ax.set_ylim(-0.02, max(1.02, ax.get_ylim()[1]))
    figure.legend(handles=ax.get_lines(), loc="outside right upper", fontsize="small")


# -------------------------------------------------------------------------------------------------------- markdown

def _title(summary: dict, train_run: dict, tokens_per_step: int | None) -> str:
    steps, seconds, speed = summary.get("steps"), train_run.get("seconds"), train_run.get("tokens_per_second")
    facts = [f"model `{str(train_run.get('model_sha256', 'unknown'))[:12]}`", f"{_fmt(steps or '?')} steps"]
    if steps and tokens_per_step:
        facts.append(f"{steps * tokens_per_step:,} tokens seen")
    if _is_number(seconds):
        facts.append(_duration(seconds) + (f" at {speed:,.0f} tokens/s" if _is_number(speed) else ""))
    if train_run.get("resumed_from") is not None:
        facts.append(f"resumed from step {train_run['resumed_from']}")
    facts += [f"MLflow run `{train_run.get('run_id', 'unknown')}`", f"on {train_run.get('machine', 'unknown')}"]
    return "# Report card\n\n" + " · ".join(facts)


def _model_section(config: dict, summary: dict, lineage: dict) -> str:
    model = config.get("model") or {}
    rows = [("parameters", _fmt(summary.get("params", "—"))), ("size", _fmt(model.get("size", "—")))]
    rows += [(key, _fmt(model.get(key, "—")))
             for key in ("d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "seq_len")]
    rows += [("vocab size", _fmt(config.get("vocab_size", "—"))), ("MoE", _moe_line(model.get("moe"))),
             ("DRE", _dre_line(model.get("dre"))),
             ("selected weights", f"step {_fmt(summary.get('selected_step', '—'))} ({summary.get('select', '—')})"
              + ("; their average over the decay (train.ema_horizon) kept" if summary.get("averaged") else ""))]
    if lineage:
        rows.append(("lineage fingerprint", f"`{lineage.get('fingerprint', '—')}`"))
        parent = lineage.get("parent")
        rows.append(("warm start from", ", ".join(f"{k} `{v}`" for k, v in parent.items()) if parent else "none"))
    return "## Model\n\n" + _table(("", "value"), rows)


def _moe_line(moe: dict | None) -> str:
    if not moe or not moe.get("enabled"):
        return "off"
    groups = moe.get("groups") or {}
    experts = sum(groups.values()) if groups else moe.get("n_experts", "?")
    split = f" ({', '.join(f'{name} {n}' for name, n in groups.items())})" if groups else ""
    return f"on: {experts} experts{split}, top-{moe.get('top_k', '?')}, {_every(moe.get('every'))}"


def _dre_line(dre: dict | None) -> str:
    if not dre or not dre.get("enabled"):
        return "off"
    forced = f" (inference: {dre['force_path']})" if dre.get("force_path") else ""
    return f"on: path {dre.get('path', '?')}{forced}, {_every(dre.get('every'))}"


def _every(every: int | None) -> str:
    return "every block" if every == 1 else f"every {every or '?'} blocks"


def _data_section(data: dict[str, dict | None], plan: dict) -> str:
    rows = []
    validate, prepared = data.get("validate"), data.get("prepared")
    if validate:
        rows.append(("corpus", _checked(validate)))
        if validate.get("cleaned"):
            rows.append(("after cleaning", _checked(validate["cleaned"])))
    if prepared:
        for split in ("train", "val"):
            part = prepared.get(split) or {}
            rows.append((f"{split} split", ", ".join(f"{_fmt(part[k])} {k}"
                                                     for k in ("tokens", "documents", "bytes") if k in part)))
        rows.append(("vocab size", f"{_fmt(prepared.get('vocab_size', '—'))} "
                                   f"(tokenizer `{prepared.get('tokenizer_sha256', '—')}`)"))
    rows += [(f"plan: {key.replace('_', ' ')}", _fmt(plan[key]))
             for key in ("precision", "attention", "compile", "max_steps", "warmup_steps", "tokens_per_step",
                         "machine") if key in plan]
    if plan:
        rows.append(("plan: budget", plan.get("budget") or "none (fixed max_steps)"))
    return "## Data and plan\n\n" + (_table(("", "value"), rows) if rows else "No data reports were available.")


def _checked(report: dict) -> str:
    verdict = "passed" if report.get("success") else "FAILED"
    return f"{_fmt(report.get('n_rows', '?'))} documents checked: {verdict}"


def _metrics_section(metrics: dict[str, Any], tasks: dict[str, dict]) -> str:
    numbers = {k: v for k, v in metrics.items() if _is_number(v)}
    baseline = {"val_bpb": numbers.get("unigram_bpb"), "val_loss": numbers.get("unigram_loss")}
    if "unigram_loss" in numbers:
        baseline["val_perplexity"] = math.exp(numbers["unigram_loss"])  # perplexity is e^loss
    rows = [(label, "↓", _num(numbers[key]), _num(baseline[key]) if baseline.get(key) is not None else "—",
             _amount(numbers, scored)) for key, (label, scored) in VAL_ROWS.items() if key in numbers]
    for task, result in sorted(tasks.items()):
        rows += _task_rows(task, result)
    rows += [(key, "", _num(value), "—", "") for key, value in sorted(numbers.items()) if key not in SHOWN]
    table = _table(("metric", "better", "model", "unigram baseline", "n"), rows)
    if "val_documents_scored" in numbers:
        table += f"\n\nThe val metrics score {_amount(numbers, 'val_documents_scored')} of the val split."
    return "## Metrics\n\n" + table


def _amount(numbers: dict[str, float], key: str) -> str:
    """'9,874 tokens' from val_tokens_scored (a float in metrics, a count to a reader)."""
    return f"{int(numbers[key]):,} {key.split('_')[1]}" if key in numbers else ""


def _task_rows(task: str, result: dict) -> list[tuple[str, ...]]:
    stderr, better = result.get("stderr") or {}, result.get("higher_is_better") or {}
    n = result.get("n")
    rows = []
    for metric, value in sorted((result.get("metrics") or {}).items()):
        if not _is_number(value):
            continue
        shown = _num(value) + (f" ± {_num(stderr[metric])}" if _is_number(stderr.get(metric)) else "")
        direction = {True: "↑", False: "↓"}.get(better.get(metric), "")
        rows.append((f"{task}: {metric}", direction, shown, "—", f"{_fmt(n)} examples" if n is not None else ""))
    return rows


def _samples_section(samples: Sequence[dict[str, str]]) -> str:
    if not samples:
        return "## Samples\n\nNo samples."
    parts = ["## Samples"]
    for i, sample in enumerate(samples, 1):
        parts.append(f"### Sample {i}\n\n" + "\n\n".join(
            f"{label}:\n\n{_code_block(sample.get(key, ''))}"
            for key, label in (("prompt", "Prompt"), ("greedy", "Greedy"), ("sampled", "Sampled"))))
    return "\n\n".join(parts)


def _code_block(text: str) -> str:
    """A fenced block that text with backticks of its own cannot close early (a fence longer than any run)."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}text\n{text}\n{fence}"


def _plots_section(links: dict[str, str]) -> str:
    return "## Plots\n\n" + "\n\n".join(f"![{title}]({link})" for title, link in links.items())


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = [header, ["---"] * len(header), *rows]
    return "\n".join("| " + " | ".join(_cell(c) for c in line) + " |" for line in lines)


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _fmt(value: Any) -> str:
    """A config or report value for a reader: null is the schema's default, counts get thousands separators."""
    if value is None:
        return "default"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_fmt(v)}" for k, v in value.items())
    return str(value)


def _num(value: float) -> str:
    return f"{value:,}" if isinstance(value, int) else f"{value:.4f}"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
