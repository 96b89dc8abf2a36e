"""The validate stage on datatrove: a corpus of several files gated and cleaned in parallel tasks gives the report
and the shards of one pass over the whole corpus in memory, whatever the number of tasks and workers; a task that
fails names its file, and the next run redoes only the parts that were not finished."""

import json
import os
from pathlib import Path

import pandas as pd
import pytest

from ultrathink.config import Params
from ultrathink.data.cleaning import clean_corpus
from ultrathink.data.constitution import load_constitution
from ultrathink.data.shards import read_index, read_shards
from ultrathink.data.sources import CorpusError
from ultrathink.data.validation import CorpusValidationError, validate_cleaned, validate_corpus

ROOT = Path(__file__).resolve().parents[1]
VALIDATE = {"min_rows": 50, "max_length": 200, "length_mostly": 0.9, "max_duplicate_fraction": 0.1,
            "min_printable_ratio": 0.9}


def distinct(n: int, start: int = 0) -> list[str]:
    return [f"document number {i} talks about topic {i * 7 % 13}" for i in range(start, start + n)]


BAD_CORPORA = {  # each file of the glob gets a quarter; the faults sit in different files
    "nulls": distinct(30) + [None] * 3 + distinct(30, 50) + [None] * 2,
    "too long": distinct(60) + ["x" * 500] * 8 + distinct(3, 100),
    "duplicates across files": distinct(40) + distinct(20),
    "unprintable": distinct(55) + ["\x00\x01\x02 binary"] * 2 + distinct(2, 300),
    "too few rows": distinct(30),
}
GOOD = (distinct(150) + ["Mail me at jo.doe@example.org today, please."] * 3 + distinct(20, 40)
        + ["  spaced out  ", "Call +1 555 123 4567 now or write to a@b.io"] + distinct(30, 400))


def write_glob(root: Path, texts: list, files: int = 4) -> None:
    raw = root / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    size = -(-len(texts) // files)
    for number in range(files):
        chunk = texts[number * size : (number + 1) * size]
        (raw / f"part{number}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in chunk))


def run_stage(root: Path, monkeypatch, constitution: bool = False, **validate) -> dict:
    from ultrathink.stages.validate import run

    monkeypatch.chdir(root)
    if constitution:
        (root / "constitution.yaml").write_text((ROOT / "constitution.yaml").read_text())
    run(Params.model_validate({"data": {"source": "raw/*.jsonl"},
                               "constitution": {"path": "constitution.yaml" if constitution else None},
                               "validate": {**VALIDATE, **validate}}))
    return json.loads(Path("reports/validate.json").read_text())


def frame(texts: list) -> pd.DataFrame:
    return pd.DataFrame({"text": pd.Series(texts, dtype=object)})


def same_results(a: list[dict], b: list[dict]) -> None:
    for x, y in zip(a, b, strict=True):
        assert {k: v for k, v in x.items() if k != "observed"} == {k: v for k, v in y.items() if k != "observed"}
        assert x["observed"] == pytest.approx(y["observed"])


@pytest.mark.spawns
@pytest.mark.parametrize("case", sorted(BAD_CORPORA))
def test_parallel_tasks_report_what_one_pass_in_memory_reports(case, tmp_path, monkeypatch):
    texts = BAD_CORPORA[case]
    write_glob(tmp_path, texts)
    with pytest.raises(CorpusValidationError) as failed:
        run_stage(tmp_path, monkeypatch, batch_rows=5, tasks=4, workers=2)
    in_memory = validate_corpus(frame(texts), Params.model_validate({"validate": VALIDATE}).validate_cfg)
    assert not in_memory.success
    report = json.loads((tmp_path / "reports/validate.json").read_text())
    same_results(report["results"], in_memory.to_dict()["results"])
    assert str(failed.value) == in_memory.summary()
    assert not (tmp_path / "data/validated/corpus").exists()  # nothing that looks like a validated corpus
    assert not list((tmp_path / "data/validated").glob(".*"))  # and no work or temp files left


@pytest.mark.spawns
def test_shards_are_identical_whatever_the_tasks_and_workers(tmp_path, monkeypatch):
    runs = {}
    for name, knobs in {"one task": {"tasks": 1, "workers": 1}, "4 tasks on 1 worker": {"tasks": 4, "workers": 1},
                        "4 tasks on 2 workers": {"tasks": 4, "workers": 2}, "2 tasks": {"tasks": 2}}.items():
        root = tmp_path / name.replace(" ", "_")
        write_glob(root, GOOD)
        report = run_stage(root, monkeypatch, constitution=True, batch_rows=16, shard_mb=0.002,
                           max_duplicate_fraction=0.3, **knobs)
        corpus = root / "data/validated/corpus"
        files = {p.name: p.read_bytes() for p in sorted(corpus.iterdir())}
        runs[name] = (report, files, list(read_shards(corpus)), read_index(corpus))
    reports, files, texts, indexes = zip(*runs.values())
    assert all(f == files[0] for f in files)  # byte for byte: shards and index
    assert all(r == reports[0] for r in reports)
    assert indexes[0]["shards"][1:] and indexes[0]["documents"] == len(texts[0])
    # ... and they are what cleaning the whole corpus at once in memory gives
    principles = load_constitution(ROOT / "constitution.yaml")
    data = Params.model_validate({}).data
    cleaned, counts = clean_corpus(frame(GOOD), data, principles)
    assert texts[0] == cleaned["text"].tolist()
    assert reports[0]["cleaning"] == counts and counts["duplicates_removed"] == 22
    assert counts["constitution"]["email"]["redactions"] == 4 and counts["constitution"]["phone"]["redactions"] == 1
    assert sum("<|email|>" in t for t in texts[0]) == 2  # the repeated redacted document is kept once
    assert reports[0]["cleaned"] == validate_cleaned(cleaned, principles, 50).to_dict()
    same_results(reports[0]["results"], validate_corpus(frame(GOOD), Params.model_validate(
        {"validate": {**VALIDATE, "max_duplicate_fraction": 0.3}}).validate_cfg).to_dict()["results"])


def test_a_failed_task_names_its_file_and_the_next_run_redoes_only_unfinished_parts(tmp_path, monkeypatch):
    """A transient fault (here: a file that reads as broken, then reads fine with the same size and time, as after a
    network filesystem's hiccup) stops the run; the parts that were finished are not redone."""
    write_glob(tmp_path, GOOD)
    flaky = tmp_path / "raw/part2.jsonl"
    good_bytes, stat = flaky.read_bytes(), flaky.stat()
    flaky.write_bytes(b"[" + good_bytes[1:])  # same size, not JSON at its first line
    os.utime(flaky, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(CorpusError, match="part2.jsonl"):
        run_stage(tmp_path, monkeypatch, tasks=4, workers=1, max_duplicate_fraction=0.3)
    work = next((tmp_path / "data/validated/.corpus.work").iterdir())
    # one worker runs the tasks in order and stops at the failed one: parts 0 and 1 are finished
    assert sorted(p.name for p in work.glob("part-*.json")) == ["part-00000.json", "part-00001.json"]
    marked = work / "part-00000.json"  # mark a finished part's counts: a rerun that redid it would lose the mark
    counts = json.loads(marked.read_text())
    counts["cleaning"]["documents_in"] += 1000
    marked.write_text(json.dumps(counts))
    flaky.write_bytes(good_bytes)
    os.utime(flaky, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    report = run_stage(tmp_path, monkeypatch, tasks=4, workers=1, max_duplicate_fraction=0.3)
    assert report["cleaning"]["documents_in"] == len(GOOD) + 1000
    assert not (tmp_path / "data/validated/.corpus.work").exists()
    # other inputs (a file changed) are not mixed with what was left: the left work is removed, all parts redone
    flaky.write_bytes(b"[" + good_bytes[1:])
    with pytest.raises(CorpusError):
        run_stage(tmp_path, monkeypatch, tasks=4, workers=1, max_duplicate_fraction=0.3)
    (tmp_path / "raw/part0.jsonl").write_text((tmp_path / "raw/part0.jsonl").read_text() + "\n")
    flaky.write_bytes(good_bytes)
    report = run_stage(tmp_path, monkeypatch, tasks=4, workers=1, max_duplicate_fraction=0.3)
    assert report["cleaning"]["documents_in"] == len(GOOD)
    assert len(list((tmp_path / "data/validated").glob(".*"))) == 0


@pytest.mark.spawns
@pytest.mark.slow
def test_the_ray_executor_writes_the_shards_the_local_one_does(tmp_path, monkeypatch):
    """executor: ray runs the same tasks on a (here local, started for the run) Ray cluster: same shards, byte for
    byte, and the same report. In a subprocess, as the stage runs, so the cluster goes with it."""
    import subprocess
    import sys

    import yaml

    pytest.importorskip("ray")
    outputs = []
    for executor in ("local", "ray"):
        root = tmp_path / executor
        write_glob(root, GOOD)
        (root / "constitution.yaml").write_text((ROOT / "constitution.yaml").read_text())
        params = yaml.safe_load((ROOT / "params.yaml").read_text())
        params["data"].update(source="raw/*.jsonl", max_samples=None)
        params["validate"].update(VALIDATE, max_duplicate_fraction=0.3, executor=executor, workers=2, shard_mb=0.002)
        (root / "params.yaml").write_text(yaml.safe_dump(params))
        (root / "dvc.yaml").write_text((ROOT / "dvc.yaml").read_text())
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"PYTHONPATH": str(ROOT)}
        done = subprocess.run([sys.executable, "-m", "tasks.validate"], cwd=root, env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        corpus = root / "data/validated/corpus"
        outputs.append(({p.name: p.read_bytes() for p in sorted(corpus.iterdir())},
                        json.loads((root / "reports/validate.json").read_text())))
    (local_files, local_report), (ray_files, ray_report) = outputs
    assert ray_files == local_files and len(local_files) > 2
    assert ray_report == local_report and local_report["cleaning"]["duplicates_removed"] == 22


def test_the_work_directory_follows_every_file_the_corpus_is_read_from(tmp_path, monkeypatch):
    """A part finished before a kill is reused only for the same inputs: editing any file read (a one-file glob,
    a file of a saved dataset, a mixture component) gives another work directory."""
    import time

    from ultrathink.data.engine import _work_dir

    monkeypatch.chdir(tmp_path)
    write_glob(tmp_path, distinct(20), files=1)
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "state.json").write_text("{}")
    (saved / "data-00000.arrow").write_bytes(b"x")
    out = tmp_path / "data/validated/corpus"
    for data, edited in (({"source": "raw/*.jsonl"}, tmp_path / "raw/part0.jsonl"),
                         ({"source": "saved"}, saved / "data-00000.arrow"),
                         ({"mixture": [{"source": "embedded", "weight": 1}, {"source": "saved", "weight": 1}]},
                          saved / "data-00000.arrow")):
        params = Params.model_validate({"data": data, "constitution": {"path": None}})
        before = _work_dir(params, tmp_path, out)
        assert _work_dir(params, tmp_path, out) == before  # stable for the same inputs
        time.sleep(0.01)
        edited.write_bytes(edited.read_bytes() + b"\n")
        assert _work_dir(params, tmp_path, out) != before, data


@pytest.mark.spawns
@pytest.mark.slow
def test_a_second_run_waits_for_the_first(tmp_path):
    """Two validate runs of one project would share the work directory of the same inputs (and the first to
    finish removes it): a run waits while another holds the project's validate lock, then writes its corpus."""
    import subprocess
    import sys
    import time

    import yaml

    from ultrathink.stages.validate import run_lock

    write_glob(tmp_path, GOOD)
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["data"].update(source="raw/*.jsonl", max_samples=None)
    params["constitution"]["path"] = None
    params["validate"].update(VALIDATE, max_duplicate_fraction=0.3, workers=1)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    (tmp_path / "dvc.yaml").write_text((ROOT / "dvc.yaml").read_text())
    corpus = tmp_path / "data/validated/corpus"
    with run_lock(str(corpus)):  # a first run, holding the lock
        second = subprocess.Popen([sys.executable, "-m", "tasks.validate"], cwd=tmp_path,
                                  env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        time.sleep(8)  # a run of this corpus takes ~5 s here
        assert second.poll() is None and not corpus.exists()
    _, err = second.communicate(timeout=300)
    assert second.returncode == 0, err[-3000:]
    cleaned, _ = clean_corpus(frame(GOOD), Params.model_validate({}).data, [])
    assert list(read_shards(corpus)) == cleaned["text"].tolist()
    assert not list((tmp_path / "data/validated").glob(".*"))
