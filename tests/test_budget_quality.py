"""benchmarks/budget_quality.py --workdir: a prepared copy is reused only by runs it was prepared for."""

import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from budget_quality import kept_project  # noqa: E402


def test_a_copy_prepared_for_equal_steps_is_not_reused_by_a_time_budget(tmp_path):
    """Before the copy's record named its sizing, a copy prepared for an equal-steps run (model.size manual, the
    shipped vocabulary) was reused by a later time budget's run, which then trained a manual model at the wrong
    vocabulary and reported it as the budget path."""
    text = "\n\n".join(f"Paragraph {i}: the {i % 7}th line of a small corpus, said again." for i in range(300))
    params_of = lambda project: yaml.safe_load((project / "params.yaml").read_text())  # noqa: E731
    for_steps = kept_project(tmp_path, text, None, [])
    assert params_of(for_steps)["model"]["size"] == "manual"
    for_budget = kept_project(tmp_path, text, "2min", [])
    assert for_budget != for_steps
    sized = params_of(for_budget)
    assert sized["model"]["size"] == "auto" and sized["tokenizer"]["vocab_size"] == "auto"
    marker = for_budget.parent / "prepared.json"
    made = marker.stat().st_mtime_ns
    assert kept_project(tmp_path, text, "12s", []) == for_budget and marker.stat().st_mtime_ns == made  # reused
