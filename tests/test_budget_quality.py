"""benchmarks/budget_quality.py: a prepared copy (--workdir) is reused only by runs it was prepared for; a row names
the seconds it took in all; the held-out text's bytes are counted as the baseline's are."""

import sys
from pathlib import Path

import pytest
import yaml

from ultrathink.data.sources import split_documents

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from budget_quality import kept_project, row_line, text_bits_per_byte  # noqa: E402


@pytest.mark.spawns
@pytest.mark.slow
def test_a_copy_is_reused_only_by_runs_sized_as_it_was(tmp_path):
    """Before the copy's record named its sizing, a copy prepared for an equal-steps run (model.size manual, the
    shipped vocabulary) was reused by a later time budget's run, which then trained a manual model at the wrong
    vocabulary and reported it as the budget path. A time budget's copy serves budgets of the same length only, as
    its vocabulary follows that length."""
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
    assert kept_project(tmp_path, text, "5min", []) == for_budget and marker.stat().st_mtime_ns == made  # reused
    # A short budget's vocabulary is another (tokenizer.auto_vocab_size): its own copy.
    assert kept_project(tmp_path, text, "12s", []) not in (for_budget, for_steps)


def test_a_row_names_the_seconds_it_took_in_all_beside_its_training_seconds():
    """A 2-minute row on a GPU took 110-150 s of a device call, not its 60-100 s of training: the line says both, so
    the next call can be sized. Rows recorded before the figure existed still print."""
    ours = {"bpb": 2.169, "seconds": 61.5, "steps": 993, "params": 32_119_360, "decay_began": 800, "selected_step": 900,
            "sizing": "d_model 576, 8 layers", "dropout": 0.2, "measured": [], "wall_seconds": 131.4}
    row = {"corpus": "tinyshakespeare", "budget": "2min", "variant": "defaults", "seed": None, "ours": ours,
           "baseline": None}
    line = row_line(row)
    assert "ours 2.1690 (62 s, 993 steps, 32.12M; 131 s in all; a plateau at step 800 began the decay; step 900's" \
           " weights kept)" in line
    del ours["wall_seconds"]
    assert "in all" not in row_line(row) and "(62 s, 993 steps, 32.12M; a plateau at step 800" in row_line(row)


def test_a_row_of_a_shape_the_run_set_names_that_shape_and_its_batch():
    """A run with model.size manual prints no sizing line, so its row read `[; dropout 0]`: nothing said what it
    trained. It names the shape and the sequences a step it trained (train.batch_size's, which the plan sizes only
    under size auto); a row of the plan's own shape keeps the sizing's line."""
    shape = {"d_model": 192, "n_layers": 3, "n_heads": 3, "n_kv_heads": 3, "seq_len": 256}
    ours = {"bpb": 2.0682, "seconds": 119.5, "steps": 663, "params": 1_513_152, "sizing": "", "dropout": 0.0,
            "measured": [], "shape": shape, "batch_size": 16}
    row = {"corpus": "tinyshakespeare", "budget": "2min", "variant": "s256", "seed": 1337, "ours": ours,
           "baseline": None}
    assert row_line(row).endswith("[set: d_model 192, 3 layers, 3 heads (3 kv), seq_len 256, batch 16; dropout 0]")
    ours["sizing"] = "d_model 256, 3 layers, 4 heads (2 kv), seq_len 256, batch 8: 2.46M params"
    assert row_line(row).endswith("[d_model 256, 3 layers, 4 heads (2 kv), seq_len 256, batch 8: 2.46M params; "
                                  "dropout 0]")


def test_the_text_score_credits_the_bytes_of_the_blank_lines_its_eos_predictions_code():
    """Our code length of a held-out text covers its paragraphs and the EOS closing each; the char-level baseline's
    covers every byte. Over the same text both divide by the same bytes: the paragraphs and the blank lines between
    them, not by the paragraphs alone (which read tiny Shakespeare's held-out 1.7% worse than the same bits)."""
    text = "ROMEO:\nBut soft!\n\nJULIET:\nAy me.\n\nROMEO:\nShe speaks.\n"
    paragraphs = split_documents(text, "paragraph")
    paragraph_bytes = sum(len(p.encode()) for p in paragraphs)
    bits = 123.0  # any code length: what matters is what it is divided by
    scored = {"bits_per_byte": bits / paragraph_bytes, "bytes": paragraph_bytes, "documents": len(paragraphs)}
    assert text_bits_per_byte(scored) == pytest.approx(bits / len(text.strip().encode()))
    assert text_bits_per_byte(scored) < scored["bits_per_byte"]
    # separators our code does not spell out (spaces on the blank line, a second blank line) are not credited
    loose = text.replace("\n\nJULIET", "\n  \n\nJULIET")
    assert split_documents(loose, "paragraph") == paragraphs
    assert text_bits_per_byte(scored) > bits / len(loose.strip().encode())
