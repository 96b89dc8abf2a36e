"""The evaluate stage's report card: the Markdown shows the scores it was given and links exactly the plots written,
the plots are real 700×400 PNGs that follow their data, the same inputs give the same bytes, and the routing plots
come and go with the routing figures in the history."""

import json
import re
import struct
from pathlib import Path

import matplotlib.image

from ultrathink.report_card import write_report_card

TASKS = {"heldout_continuation": {"metrics": {"acc": 0.61, "acc_norm": 0.64}, "stderr": {"acc": 0.03, "acc_norm": None},
                                  "n": 200, "higher_is_better": {"acc": True, "acc_norm": True}}}
METRICS = {"val_loss": 4.4457, "val_perplexity": 85.26, "val_bpb": 1.59897, "val_tokens_scored": 9874.0,
           "val_bytes_scored": 39607.0, "val_documents_scored": 215.0, "unigram_loss": 6.5202, "unigram_bpb": 2.3451,
           "yardstick_sha256": "5558", "mlflow_run_id": "run123"}


def history(routed: bool = False, scale: float = 1.0) -> list[dict]:
    rows = []
    for step in range(10, 101, 10):
        row = {"step": step, "train_loss": scale * 8 / step ** 0.3, "lr": 1e-3 * min(1, step / 30),
               "grad_norm": 1.0 / step, "skipped_steps": 0.0}
        if step % 50 == 0:
            row["val_loss"] = scale * 9 / step ** 0.3
        if routed:
            row |= {"moe_entropy": 0.8, "moe_max_expert_share": 0.3, "moe/layer1/entropy": 0.79,
                    "moe/layer3/entropy": 0.81, "moe/knowledge/entropy": 0.9,
                    "dre_kept": 0.5, "dre_flops_ratio": 0.7, "dre_routed": 1.0, "dre/layer1/kept": 0.5}
        rows.append(row)
    return rows


def model_dir(root: Path, rows: list[dict], model: dict | None = None) -> Path:
    directory = root / "model"
    directory.mkdir(parents=True, exist_ok=True)
    model = model if model is not None else {"d_model": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": None,
                                             "seq_len": 32, "moe": {"enabled": False}, "dre": {"enabled": False}}
    files = {"config.json": {"vocab_size": 512, "model": model}, "history.json": rows,
             "train_summary.json": {"steps": 100, "params": 123456,
                                    "plan": {"precision": "fp32", "max_steps": 100, "tokens_per_step": 256}}}
    for name, content in files.items():
        (directory / name).write_text(json.dumps(content))
    return directory


def report(root: Path, rows: list[dict], timings: bool = True, model: Path | None = None) -> tuple[str, list[Path]]:
    train_run = {"run_id": "run123", "model_sha256": "ab" * 32, "seconds": 3.5, "machine": "cpu"}
    if timings:
        train_run["timings"] = [{"step": s, "tokens_per_second": 1000.0 + s, "mfu": 0.2} for s in (10, 50, 100)]
    written = write_report_card(
        markdown=root / "reports" / "report.md", plots_dir=root / "reports" / "plots",
        model_dir=model or model_dir(root, rows), metrics=METRICS, tasks=TASKS,
        samples=[{"prompt": "A | B", "greedy": "x ``` y", "sampled": "z"}], train_run=train_run,
        data={"validate": {"success": True, "n_rows": 2608}, "prepared": None})
    return (root / "reports" / "report.md").read_text(), written


def pngs(written: list[Path]) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in written if p.suffix == ".png"}


def table_row(markdown: str, label: str) -> str:
    return next(line for line in markdown.splitlines() if line.startswith(f"| {label} |"))


def test_metrics_table_has_the_model_beside_the_baseline_and_each_task_metric_with_its_stderr(tmp_path):
    markdown, _ = report(tmp_path, history())
    assert "1.5990" in table_row(markdown, "val bits per byte") and "2.3451" in table_row(markdown, "val bits per byte")
    assert "39,607 bytes" in table_row(markdown, "val bits per byte")
    assert "678.7" in table_row(markdown, "val perplexity")  # the baseline's perplexity is e^unigram_loss
    acc = table_row(markdown, "heldout_continuation: acc")
    assert "0.6100 ± 0.0300" in acc and "200 examples" in acc and "↑" in acc
    assert "| 0.6400 |" in table_row(markdown, "heldout_continuation: acc_norm")  # no stderr: no "±"
    assert "run123" in markdown.split("## Model")[0] and "25,600 tokens seen" in markdown  # 100 steps × 256
    assert "mlflow_run_id" not in markdown  # strings in metrics are not metrics


def test_model_section_shows_null_as_default_and_survives_an_older_config(tmp_path):
    markdown, _ = report(tmp_path, history(), model=model_dir(tmp_path, history(), model={"d_model": 64}))
    assert "| d_model | 64 |" in markdown and "| n_heads | — |" in markdown and "| MoE | off |" in markdown
    markdown, _ = report(tmp_path, history())
    assert "| n_kv_heads | default |" in markdown


def test_samples_are_fenced_so_their_own_backticks_and_pipes_stay_text(tmp_path):
    markdown, _ = report(tmp_path, history())
    assert "````text\nx ``` y\n````" in markdown and "```text\nA | B\n```" in markdown


def test_the_markdown_links_exactly_the_plots_written_relative_to_itself(tmp_path):
    markdown, written = report(tmp_path, history())
    links = re.findall(r"!\[[^\]]+\]\(([^)]+)\)", markdown)
    assert all(not Path(link).is_absolute() for link in links)
    assert {(tmp_path / "reports" / link).resolve() for link in links} == {p.resolve() for p in written[1:]}
    assert written[0] == tmp_path / "reports" / "report.md"
    assert set(pngs(written)) == {"loss.png", "lr.png", "grad_norm.png", "throughput.png"}


def test_routing_plots_only_with_routing_figures_and_a_stale_one_is_removed(tmp_path):
    _, written = report(tmp_path, history(routed=True))
    assert {"moe.png", "dre.png"} <= set(pngs(written))
    keep = tmp_path / "reports" / "plots" / "notes.txt"
    keep.write_text("not a plot")
    _, written = report(tmp_path, history(), timings=False)  # MoE and DRE off; an older run without timings
    assert set(pngs(written)) == {"loss.png", "lr.png", "grad_norm.png"}
    assert sorted(p.name for p in (tmp_path / "reports" / "plots").iterdir()) == ["grad_norm.png", "loss.png",
                                                                                   "lr.png", "notes.txt"]


def test_plots_are_png_images_of_the_figure_size(tmp_path):
    _, written = report(tmp_path, history(routed=True))
    for name, data in pngs(written).items():
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", name
        assert struct.unpack(">II", data[16:24]) == (700, 400), name
        assert b"Software" not in data, name  # no matplotlib version stamp: an upgrade alone changes no bytes
    assert matplotlib.image.imread(written[1]).shape == (400, 700, 4)


def test_same_inputs_same_bytes_and_the_loss_plot_follows_the_loss(tmp_path):
    first = pngs(report(tmp_path / "a", history(routed=True))[1])
    assert first == pngs(report(tmp_path / "b", history(routed=True))[1])
    other = pngs(report(tmp_path / "c", history(routed=True, scale=0.5))[1])
    assert other["loss.png"] != first["loss.png"]
    assert other["lr.png"] == first["lr.png"]  # only the losses changed
