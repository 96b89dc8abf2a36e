"""Tokenized train/val splits as flat token files (in shards) that the trainer reads window by window.

Every document is framed as its tokenizer frames a text (a Llama-style tokenizer's BOS before it; none for ours:
scoring.document_prefix) and followed by one EOS id; documents are concatenated. Two ways to
choose the split (`prepare.split`):
  hash  a document's split follows from a hash of its text alone, so it does not depend on order, seed or machine,
        and copies of one text always land in the same split (no train/val leakage through duplicates);
  tail  the last `val_fraction` of the corpus, by characters, is val: the document that straddles the cut is split
        at a line start (so a single-document corpus gives its beginning to train and its end to val).

Memory stays bounded whatever the corpus size: the corpus is read line by line, tokenized in batches by a pool of
processes (a bounded number of batches in flight), and the token files are written batch by batch. Documents longer
than `_MAX_PIECE_CHARS` are encoded in pieces cut where our byte-level BPE cannot merge across (a line start), so the
ids are those of the whole document; a pretrained tokenizer (tokenizer.pretrained) encodes every document whole.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from multiprocessing import get_all_start_methods, get_context
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ultrathink.config import PrepareConfig
from ultrathink.data.shards import is_sharded, read_shards, text_bytes
from ultrathink.data.token_checks import check_token_files
from ultrathink.data.tokens import META_FILE, SPLITS
from ultrathink.io import atomic_dir
from ultrathink.scoring import document_prefix
from ultrathink.tokenizer import load_tokenizer, tokenizer_hash

VAL_TEXT_FILE = "val.jsonl"  # the val documents' text, one {"text": ...} per line: what evaluation scores
_MAX_PIECE_CHARS = 1 << 20  # longer documents are encoded piece by piece (ids unchanged; see _pieces)
_BATCH_CHARS = 4 << 20  # a batch also ends after this many characters, so a few huge documents stay bounded


@dataclass
class SplitPlan:
    """Where each document goes. hash: `in_val` has one flag per document. tail: document `cut_document` is cut at
    character `cut_offset`; documents before it (and its head) are train, the rest val."""

    split: str
    documents: int
    in_val: np.ndarray | None = None
    moved_last_document_to: str | None = None
    cut_document: int | None = None
    cut_offset: int | None = None

    def pieces(self, number: int, text: str) -> Iterator[tuple[str, bool]]:
        """(text, is_val) for the parts of document `number` (one part, or two for the cut document)."""
        if self.split == "hash":
            yield text, bool(self.in_val[number])
        elif number != self.cut_document:
            yield text, number > self.cut_document
        else:
            if self.cut_offset > 0:
                yield text[: self.cut_offset], False
            yield text[self.cut_offset :], True

    def describe(self) -> dict:
        if self.split == "hash":
            return {"split": "hash", "moved_last_document_to": self.moved_last_document_to}
        return {"split": "tail", "cut_document": self.cut_document, "cut_offset": self.cut_offset}


@dataclass
class _Batch:
    """Text pieces to encode; `starts[i]` says whether piece i begins its document (gets the tokenizer's prefix),
    `ends[i]` whether it ends it (gets an EOS, counts as one)."""

    texts: list[str] = field(default_factory=list)
    in_val: list[bool] = field(default_factory=list)
    starts: list[bool] = field(default_factory=list)
    ends: list[bool] = field(default_factory=list)
    chars: int = 0


def prepare_splits(corpus: Path, tokenizer_dir: Path, cfg: PrepareConfig, out_dir: Path,
                   report_dir: Path | None = None) -> dict:
    """Write each split's token files (train-00000.bin, ...; a new one every `prepare.shard_tokens`), val.jsonl and
    meta.json into `out_dir` (replaced as a whole at the end); return the meta.

    meta.json: dtype, vocab_size, eos_id, val_fraction, split (hash|tail) with moved_last_document_to (hash: the
    split that received the last document because hashing left it empty, else None) or cut_document/cut_offset
    (tail), and per split: tokens, bytes (UTF-8 bytes of the documents' text, the bits-per-byte denominator),
    documents and shards (its files in order, each with its tokens), and tokenizer_sha256
    (ultrathink.tokenizer.tokenizer_hash). val.jsonl holds the text of the val documents (the cut document's val part
    is one), each as encoded into the val files. The token files are checked before they replace `out_dir` (ids <
    vocab, no empty documents, no document in both splits, shards ending at document ends); the check's report goes
    to `report_dir` when given, and a failed check raises TokenCheckError, leaving `out_dir` untouched.
    """
    corpus, out_dir = Path(corpus), Path(out_dir)
    tokenizer = load_tokenizer(tokenizer_dir)
    dtype = np.dtype(np.uint16 if len(tokenizer) <= 65535 else np.uint32)
    plan = plan_splits(corpus, cfg)
    stats = {split: {"tokens": 0, "bytes": 0, "documents": 0} for split in SPLITS}
    with atomic_dir(out_dir) as tmp:
        max_piece = _MAX_PIECE_CHARS if cuts_at_line_starts(tokenizer) else None
        _write_token_files(corpus, plan, cfg, Path(tokenizer_dir), max_piece, tmp, dtype, stats)
        meta = {"dtype": dtype.name, "vocab_size": len(tokenizer), "eos_id": tokenizer.eos_token_id,
                "tokenizer_sha256": tokenizer_hash(tokenizer_dir), "val_fraction": cfg.val_fraction,
                **plan.describe(), **stats}
        check_token_files(tmp, meta, tokenizer, report_dir)
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")  # last: marks the output complete
    return meta


def plan_splits(corpus: Path, cfg: PrepareConfig) -> SplitPlan:
    """First pass over the corpus: decide every document's split (hash: a flag each; tail: where to cut)."""
    if cfg.split == "hash":
        in_val = np.fromiter((split_fraction(t) < cfg.val_fraction for t in read_texts(corpus)), dtype=bool)
        _need_two(corpus, len(in_val))
        plan = SplitPlan("hash", len(in_val), in_val=in_val)
        if in_val.all() or not in_val.any():
            plan.moved_last_document_to = "train" if in_val[-1] else "val"
            in_val[-1] = not in_val[-1]
        return plan
    lengths = np.fromiter((len(t) for t in read_texts(corpus)), dtype=np.int64)
    if lengths.sum() < 2:
        raise ValueError(f"{corpus}: {lengths.sum()} character(s); train and val need at least one each")
    target = int(lengths.sum() * (1 - cfg.val_fraction)) or 1  # characters that go to train
    ends = np.cumsum(lengths)
    # The document holding character number `target` (0-based): the first whose end lies beyond it. (side="left"
    # picked the document ending exactly at the cut, leaving val an empty piece of it.)
    cut_document = int(np.searchsorted(ends, target, side="right"))
    offset = target - int(ends[cut_document] - lengths[cut_document])
    text = next(t for i, t in enumerate(read_texts(corpus)) if i == cut_document)
    line_start = text.rfind("\n", 0, offset) + 1  # cut at a line start when the document has one before the cut
    return SplitPlan("tail", len(lengths), cut_document=cut_document, cut_offset=line_start or offset)


def training_texts(corpus: Path, cfg: PrepareConfig) -> Iterator[str]:
    """The text that prepare puts in the train split (whole documents or the head of the cut one): what the
    tokenizer may learn from, so validation text stays unseen."""
    plan = plan_splits(Path(corpus), cfg)
    for number, text in enumerate(read_texts(corpus)):
        yield from (piece for piece, is_val in plan.pieces(number, text) if not is_val)


def val_documents(prepared_dir: Path, max_bytes: int | None = None) -> list[str]:
    """The val split's documents as text (val.jsonl), in order; with `max_bytes`, the first ones that fit in
    that many UTF-8 bytes (at least one)."""
    path = Path(prepared_dir) / VAL_TEXT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {VAL_TEXT_FILE} in {prepared_dir}: re-run the prepare stage")
    documents, total = [], 0
    for text in read_texts(path):
        size = len(text.encode("utf-8"))
        if documents and max_bytes is not None and total + size > max_bytes:
            break
        documents.append(text)
        total += size
    return documents


def split_fraction(text: str) -> float:
    """A stable pseudo-random number in [0, 1) from the text alone: the same on every machine and run."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def read_texts(corpus: Path, progress=None) -> Iterator[str]:
    """The corpus's texts, streamed: the validate stage's shards (a directory, ultrathink.data.shards), or the
    "text" of each line of a JSON-lines file (blank lines skipped, anything else malformed is an error).
    `progress` (a tqdm bar), when given, advances by the bytes read."""
    if is_sharded(corpus):
        yield from read_shards(corpus, progress)
        return
    with open(corpus, "rb") as lines:
        for number, line in enumerate(lines, start=1):
            if progress is not None:
                progress.update(len(line))
            if not line.strip():
                continue
            try:
                text = json.loads(line).get("text")
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
                raise ValueError(f"{corpus}:{number}: not a JSON object: {exc}") from None
            if not isinstance(text, str):
                got = "null or no 'text' key" if text is None else type(text).__name__
                raise ValueError(f"{corpus}:{number}: 'text' must be a string, got {got}")
            yield text


def _need_two(corpus: Path, n: int) -> None:
    if n < 2:
        raise ValueError(f"{corpus}: {n} document(s); train and val need at least one each")


# ---- the streaming writer ----------------------------------------------------------------------------------------

def _write_token_files(corpus: Path, plan: SplitPlan, cfg: PrepareConfig, tokenizer_dir: Path,
                       max_piece: int | None, out: Path, dtype: np.dtype, stats: dict) -> None:
    """Second pass: encode batches in worker processes, in order, appending each split's ids to its file."""
    workers = cfg.workers or os.cpu_count() or 1
    with ExitStack() as stack:
        files = {split: stack.enter_context(_ShardedTokenFile(out, split, cfg.shard_tokens)) for split in SPLITS}
        val_text = stack.enter_context(open(out / VAL_TEXT_FILE, "w", encoding="utf-8"))
        bar = stack.enter_context(tqdm(total=text_bytes(corpus), unit="B", unit_scale=True,
                                       desc="prepare", disable=None))
        batches = _batches(corpus, plan, cfg.batch_size, bar, max_piece)
        pending = ""  # val text of a document whose last piece is still to come
        for batch, encoded in _encode_in_order(batches, tokenizer_dir, dtype, workers, stack):
            for split, (ids, counts) in zip(SPLITS, encoded):
                files[split].write(ids)
                for key, value in counts.items():
                    stats[split][key] += value
            for text, is_val, ends in zip(batch.texts, batch.in_val, batch.ends):
                if is_val:
                    pending += text
                    if ends:
                        val_text.write(json.dumps({"text": pending}, ensure_ascii=False) + "\n")
                        pending = ""
    for split in SPLITS:
        stats[split]["shards"] = files[split].shards


class _ShardedTokenFile:
    """One split's ids appended batch by batch to `<split>-NNNNN.bin`, a new file once the current one holds
    `shard_tokens` (batches end at document ends, so every shard starts at a document's first token)."""

    def __init__(self, out: Path, split: str, shard_tokens: int):
        self.out, self.split, self.shard_tokens = out, split, shard_tokens
        self.shards: list[dict] = []
        self._file = None

    def write(self, ids: np.ndarray) -> None:
        if self._file is None or (len(ids) and self.shards[-1]["tokens"] >= self.shard_tokens):
            self._start()
        self._file.write(ids.tobytes())
        self.shards[-1]["tokens"] += len(ids)

    def _start(self) -> None:
        if self._file is not None:
            self._file.close()
        name = f"{self.split}-{len(self.shards):05d}.bin"
        self._file = open(self.out / name, "wb")
        self.shards.append({"file": name, "tokens": 0})

    def __enter__(self) -> "_ShardedTokenFile":
        return self

    def __exit__(self, *exc) -> None:
        if self._file is not None:
            self._file.close()


def cuts_at_line_starts(tokenizer) -> bool:
    """Whether encoding a text in pieces cut at line starts gives the ids of the whole (see _pieces): true of the
    byte-level BPE with GPT-2's split pattern that ultrathink.tokenizer trains, not assumed of any other."""
    pre = json.loads(tokenizer.backend_tokenizer.to_str()).get("pre_tokenizer") or {}
    return pre.get("type") == "ByteLevel" and pre.get("use_regex", True)


def _batches(corpus: Path, plan: SplitPlan, size: int, progress, max_piece: int | None) -> Iterator[_Batch]:
    """Consecutive batches of at most `size` documents and about `_BATCH_CHARS` characters; documents longer than
    `max_piece` in pieces (None: whole)."""
    batch, documents = _Batch(), 0
    for number, text in enumerate(read_texts(corpus, progress)):
        for part, is_val in plan.pieces(number, text):
            pieces = _pieces(part, max_piece) if max_piece else [part]
            for i, piece in enumerate(pieces):
                batch.texts.append(piece)
                batch.in_val.append(is_val)
                batch.starts.append(i == 0)
                batch.ends.append(i == len(pieces) - 1)
                batch.chars += len(piece)
        documents += 1
        if documents == size or batch.chars >= _BATCH_CHARS:
            yield batch
            batch, documents = _Batch(), 0
    if batch.texts:
        yield batch


def _pieces(text: str, max_chars: int) -> list[str]:
    """`text` cut into pieces of about `max_chars` at line starts followed by a non-space character. Byte-level BPE
    pre-tokenization always ends a pre-token after such a newline (only whitespace runs take a newline, and the
    next character is not whitespace), and merges never cross pre-tokens: encoding the pieces one by one gives
    exactly the ids of the whole text. A text without such a cut point stays whole."""
    pieces, start = [], 0
    while len(text) - start > max_chars:
        cut = start + max_chars
        while cut < len(text) and not (text[cut - 1] == "\n" and not text[cut].isspace()):
            cut = text.find("\n", cut) + 1 or len(text)
        if cut >= len(text):
            break
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


def _encode_in_order(batches: Iterator[_Batch], tokenizer_dir: Path, dtype: np.dtype, workers: int,
                     stack: ExitStack) -> Iterator[tuple[_Batch, tuple]]:
    """(batch, its encoding) in input order. With several workers, a process pool with at most 2 batches per worker in
    flight (Pool.imap would read the whole corpus ahead into its queue); with one, in this process."""
    if workers == 1:
        _init_worker(tokenizer_dir, dtype)
        yield from ((batch, _encode_batch(batch)) for batch in batches)
        return
    # fork: workers start at once with the modules already imported; spawn where fork does not exist.
    context = get_context("fork" if "fork" in get_all_start_methods() else "spawn")
    pool = stack.enter_context(ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker,
                                                   initargs=(tokenizer_dir, dtype)))
    pending: deque = deque()
    for batch in batches:
        pending.append((batch, pool.submit(_encode_batch, batch)))
        if len(pending) >= 2 * workers:
            done, future = pending.popleft()
            yield done, future.result()
    while pending:
        done, future = pending.popleft()
        yield done, future.result()


_worker: dict = {}  # per process: the backend tokenizer, document prefix, EOS id and dtype, set by _init_worker


def _init_worker(tokenizer_dir: Path, dtype: np.dtype) -> None:
    tokenizer = load_tokenizer(tokenizer_dir)
    # The backend encodes exactly as the transformers wrapper does (no added special tokens, literal special-token
    # text kept as text) without building a BatchEncoding per call.
    _worker.update(backend=tokenizer.backend_tokenizer, prefix=document_prefix(tokenizer),
                   eos=tokenizer.eos_token_id, dtype=dtype)


def _encode_batch(batch: _Batch) -> tuple:
    """((train ids, counts), (val ids, counts)): each piece's ids, the tokenizer's prefix (BOS) before a document's
    first piece and EOS after its last."""
    encodings = _worker["backend"].encode_batch_fast(batch.texts, add_special_tokens=False)
    out = []
    for split_is_val in (False, True):
        ids: list[int] = []
        counts = {"tokens": 0, "bytes": 0, "documents": 0}
        for text, encoding, is_val, starts, ends in zip(batch.texts, encodings, batch.in_val, batch.starts,
                                                        batch.ends):
            if is_val != split_is_val:
                continue
            if starts:
                ids += _worker["prefix"]
            ids += encoding.ids
            if ends:
                ids.append(_worker["eos"])
                counts["documents"] += 1
            counts["bytes"] += len(text.encode("utf-8"))
        counts["tokens"] = len(ids)
        out.append((np.array(ids, dtype=_worker["dtype"]), counts))
    return tuple(out)
