"""Token-level checks of the packed files, after prepare: cheap, read straight from the written files.

Per split: every id is below the vocabulary size, the split ends with EOS and so does each of its shard files, no
document is empty (two EOS in a row), and the document count matches the meta. Across splits: no document (compared
by a hash of its token ids) is in
both train and val. The outcome goes to token_report.json and a small token_report.html; a failure raises
TokenCheckError naming each failed check.
"""

from __future__ import annotations

import hashlib
import html
from pathlib import Path

import numpy as np

from ultrathink.data.tokens import TokenShards, open_split
from ultrathink.errors import StageError
from ultrathink.io import atomic_write_json, atomic_write_text

REPORT_JSON = "token_report.json"
REPORT_HTML = "token_report.html"
_CHUNK = 1 << 24  # tokens scanned at a time: memory stays bounded for any file size
_EXAMPLES = 3


class TokenCheckError(StageError):
    """The packed token files break a check; the message names the split, the check and the counts."""


def check_token_files(prepared: Path, meta: dict, tokenizer, report_dir: Path | None = None) -> dict:
    """Check the train and val token files in `prepared` against `meta`; write the report to `report_dir` if given."""
    files = {split: open_split(prepared, meta, split) for split in ("train", "val")}
    splits = {split: _split_facts(tokens, meta["vocab_size"], meta["eos_id"]) for split, tokens in files.items()}
    (train_hashes, _), (val_hashes, val_starts) = splits["train"].pop("_docs"), splits["val"].pop("_docs")
    shared, _, in_val = np.intersect1d(train_hashes, val_hashes, return_indices=True)
    examples = [tokenizer.decode(_document(files["val"], int(val_starts[i]), meta["eos_id"]))[:80]
                for i in in_val[:_EXAMPLES]]
    checks = []
    for split, facts in splits.items():
        checks += [
            _check(f"{split}: ids below vocab size",
                   facts["out_of_vocab"] == 0, f"{facts['out_of_vocab']} ids ≥ {meta['vocab_size']} "
                   f"(largest {facts['max_id']})"),
            _check(f"{split}: ends with EOS", facts["ends_with_eos"], "the last token is EOS"
                   if facts["ends_with_eos"] else "the last document has no EOS: the file is truncated"),
            _check(f"{split}: no empty documents", facts["empty_documents"] == 0,
                   f"{facts['empty_documents']} empty documents (EOS right after EOS)"),
            _check(f"{split}: document count", facts["documents"] == meta[split]["documents"],
                   f"{facts['documents']} documents in the file, meta.json says {meta[split]['documents']}"),
            _check(f"{split}: shards end at document ends", not facts["shards_cut_inside_a_document"],
                   f"{len(files[split].paths)} shard(s); "
                   + (f"{facts['shards_cut_inside_a_document']} end inside a document"
                      if facts["shards_cut_inside_a_document"] else "each ends with EOS, so a reader of a shard "
                      "reads whole documents")),
        ]
    checks.append(_check("train/val: no shared documents", len(shared) == 0,
                         f"{len(shared)} documents are in both splits", examples))
    report = {"success": all(c["success"] for c in checks), "vocab_size": meta["vocab_size"],
              "splits": splits, "checks": checks}
    if report_dir is not None:
        atomic_write_json(Path(report_dir) / REPORT_JSON, report)
        atomic_write_text(Path(report_dir) / REPORT_HTML, render_html(report))
    if not report["success"]:
        failed = [f" - {c['name']}: {c['message']}" for c in checks if not c["success"]]
        raise TokenCheckError("token checks FAILED:\n" + "\n".join(failed))
    return report


def _check(name: str, success: bool, message: str, examples: list[str] | None = None) -> dict:
    return {"name": name, "success": bool(success), "message": message, "examples": examples or []}


def _split_facts(tokens: TokenShards, vocab_size: int, eos_id: int) -> dict:
    """Counts over one token file, read in chunks, and each document's 64-bit hash and start (8 + 8 bytes per
    document: a 1M-document corpus needs 16 MB; a chance collision across 1M documents is ~1e-7)."""
    max_id, out_of_vocab, ends = -1, 0, []
    for start in range(0, len(tokens), _CHUNK):
        chunk = np.asarray(tokens[start : start + _CHUNK])
        max_id = max(max_id, int(chunk.max()))
        out_of_vocab += int((chunk >= vocab_size).sum())
        ends.append(np.flatnonzero(chunk == eos_id) + start)
    ends = np.concatenate(ends) if ends else np.array([], dtype=np.int64)
    starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64) if len(ends) else ends
    lengths = ends - starts
    return {
        "tokens": int(len(tokens)), "documents": int(len(ends)), "max_id": max_id, "out_of_vocab": out_of_vocab,
        "empty_documents": int((lengths == 0).sum()),
        "ends_with_eos": bool(len(tokens)) and int(tokens[-1]) == eos_id,
        "mean_document_tokens": round(float(lengths.mean()), 2) if len(ends) else 0.0,
        # the split's last shard is the split's end: "ends with EOS" checks it
        "shards_cut_inside_a_document": sum(length > 0 and int(tokens[int(end) - 1]) != eos_id
                                            for length, end in zip(tokens.lengths[:-1], tokens.ends[:-1])),
        "_docs": (_document_hashes(tokens, starts, ends), starts),
    }


def _document_hashes(tokens: TokenShards, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """A 64-bit hash of each document's ids, reading the file one chunk of whole documents at a time."""
    hashes = np.empty(len(starts), dtype=np.uint64)
    first = 0
    while first < len(starts):
        # Documents [first, last) fit in one chunk (at least one document, however long).
        last = max(first + 1, int(np.searchsorted(ends, starts[first] + _CHUNK, side="right")))
        base = int(starts[first])
        chunk = np.asarray(tokens[base : int(ends[last - 1])])
        for i, (s, e) in enumerate(zip((starts[first:last] - base).tolist(), (ends[first:last] - base).tolist())):
            hashes[first + i] = int.from_bytes(hashlib.blake2b(chunk[s:e].tobytes(), digest_size=8).digest(), "big")
        first = last
    return hashes


def _document(tokens: TokenShards, start: int, eos_id: int) -> list[int]:
    """The ids of the document starting at `start` (up to its EOS), for an example in the report."""
    window = np.asarray(tokens[start : start + 4096])
    end = np.flatnonzero(window == eos_id)
    return window[: end[0] if len(end) else len(window)].tolist()


def render_html(report: dict) -> str:
    """A one-page summary: the verdict, a table of checks and a table of per-split counts."""
    esc = html.escape
    rows = "".join(
        f"<tr class={'ok' if c['success'] else 'bad'}><td>{'✓' if c['success'] else '✗'}</td><td>{esc(c['name'])}"
        f"</td><td>{esc(c['message'])}{''.join(f'<br><code>{esc(x)}</code>' for x in c['examples'])}</td></tr>"
        for c in report["checks"])
    keys = ["tokens", "documents", "mean_document_tokens", "max_id", "out_of_vocab", "empty_documents"]
    facts = "".join(f"<tr><td>{esc(split)}</td>{''.join(f'<td>{f[k]}</td>' for k in keys)}</tr>"
                    for split, f in report["splits"].items())
    verdict = "passed" if report["success"] else "FAILED"
    return (
        "<!doctype html><meta charset=utf-8><title>Token checks</title><style>body{font-family:sans-serif}"
        "td,th{padding:2px 8px;text-align:left}.ok{color:#070}.bad{color:#b00;font-weight:bold}</style>"
        f"<h1>Token checks {verdict}</h1><p>vocabulary size {report['vocab_size']}</p>"
        f"<table><tr><th></th><th>check</th><th>result</th></tr>{rows}</table><h2>Splits</h2>"
        f"<table><tr><th>split</th>{''.join(f'<th>{k}</th>' for k in keys)}</tr>{facts}</table>\n")
