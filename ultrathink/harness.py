"""lm-evaluation-harness's view of an UltraThink model: the harness's `LM` interface on our model and its tokenizer,
and `run_tasks`, which runs lm-eval's tasks on it.

Like ultrathink/scoring.py, this module imports nothing else from ultrathink, on purpose: a registered model is
evaluated under its own code (its package snapshot, see ultrathink.text_eval), and that process loads this file by
path beside the snapshot's model classes. All it asks of a model is `model(ids)[0]`, the logits of every position,
and `model.cfg.seq_len`.

How requests become tokens: every request is scored as the model saw a document in training, after `frame` (the EOS
that precedes each packed document and the tokenizer's own prefix, e.g. a Llama BOS; see
scoring.document_prefix). A (context, continuation) pair is split as the harness's own models split it: spaces
that end the context move to the continuation, and the continuation's tokens are those that encoding
context + continuation adds to encoding the context. When context and continuation do not fit the model's window,
the continuation is scored in windows from its end backwards, each the `seq_len` tokens before its last
prediction, so every continuation token is predicted once, with as much context as a window holds.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from lm_eval import simple_evaluate
from lm_eval.api.model import LM
from lm_eval.tasks import TaskManager
from lm_eval.utils import handle_non_serializable

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's default for generate_until
BOOTSTRAP_ITERS = 1000  # resamples for the stderr of metrics without a closed form (lm-eval's default: 100,000)


def windows(tokens: list[int], first: int, width: int) -> Iterator[tuple[list[int], list[int]]]:
    """(inputs, targets) pairs that predict each of tokens[first:] once: targets are the predictions of the last
    len(targets) positions of inputs. Taken from the end backwards, each window's inputs are the `width` tokens
    before its last target (fewer at the start of `tokens`)."""
    end = len(tokens)
    while end > first:
        start = max(first, end - width)
        yield tokens[max(0, end - 1 - width) : end - 1], tokens[start:end]
        end = start


class UltraThinkLM(LM):
    """loglikelihood, loglikelihood_rolling and generate_until (greedy) of a model and its own tokenizer, batched:
    windows are sorted by length and right-padded (a causal model's predictions do not see the padding after
    them)."""

    def __init__(self, model, tokenizer, frame: Sequence[int], batch_size: int = 8):
        super().__init__()
        self.model, self.tokenizer = model.eval(), tokenizer
        self.frame, self.batch_size, self.width = list(frame), max(1, int(batch_size)), model.cfg.seq_len
        self._device = next(model.parameters()).device

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def split(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(framed context ids, continuation ids) of a request (see the module's docstring)."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        head = self.encode(context)
        return self.frame + head, self.encode(context + continuation)[len(head) :]

    @torch.inference_mode()
    def score(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """For each (context ids, continuation ids): the log-probability of the continuation and whether greedy
        decoding would produce it."""
        work = [(i, inputs, targets) for i, (context, continuation) in enumerate(pairs)
                for inputs, targets in windows(context + continuation, len(context), self.width)]
        work.sort(key=lambda item: -len(item[1]))
        totals, greedy = [0.0] * len(pairs), [True] * len(pairs)
        for start in range(0, len(work), self.batch_size):
            batch = work[start : start + self.batch_size]
            logits = self.forward([inputs for _, inputs, _ in batch])
            for row, (i, inputs, targets) in enumerate(batch):
                n, k = len(inputs), len(targets)
                logprobs = F.log_softmax(logits[row, n - k : n].double(), dim=-1)  # sums of many: in fp64
                expected = torch.tensor(targets, device=logprobs.device)
                totals[i] += logprobs.gather(1, expected[:, None]).sum().item()
                greedy[i] = greedy[i] and bool((logprobs.argmax(-1) == expected).all())
        return list(zip(totals, greedy))

    def forward(self, rows: list[list[int]]) -> torch.Tensor:
        """Logits (len(rows), longest, vocab) of rows right-padded to the longest (with EOS)."""
        width = max(len(r) for r in rows)
        pad = self.tokenizer.eos_token_id
        ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long, device=self._device)
        return self.model(ids)[0]

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return self.score([self.split(*r.args) for r in requests])

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        return [logprob for logprob, _ in self.score([(self.frame, self.encode(r.args[0])) for r in requests])]

    @torch.inference_mode()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, each cut before the first of its `until` strings (default: the EOS token's
        text), of at most `max_gen_toks` tokens; the window slides when the text outgrows the context."""
        out: list[str] = [""] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(json.dumps(r.args[1], sort_keys=True, default=str), []).append(i)
        for indices in groups.values():
            until, max_new = self.generation_settings(requests[indices[0]].args[1])
            for start in range(0, len(indices), self.batch_size):
                chunk = indices[start : start + self.batch_size]
                texts = self.greedy([requests[i].args[0] for i in chunk], until, max_new)
                for i, text in zip(chunk, texts):
                    out[i] = text
        return out

    def generation_settings(self, kwargs: dict) -> tuple[list[str], int]:
        kwargs = dict(kwargs or {})
        if kwargs.get("do_sample") or float(kwargs.get("temperature") or 0.0) > 0:
            raise ValueError(f"generate_until: this model generates greedily only; the task asks for sampling "
                             f"({kwargs})")
        until = kwargs.get("until") or [self.tokenizer.decode([self.tokenizer.eos_token_id])]
        return ([until] if isinstance(until, str) else list(until)), int(kwargs.get("max_gen_toks",
                                                                                    DEFAULT_MAX_GEN_TOKS))

    def greedy(self, contexts: list[str], until: list[str], max_new: int) -> list[str]:
        rows = [self.frame + self.encode(c) for c in contexts]
        made: list[list[int]] = [[] for _ in contexts]
        live = list(range(len(contexts)))
        for _ in range(max_new):
            if not live:
                break
            inputs = [rows[i][-self.width :] for i in live]
            logits = self.forward(inputs)
            following = [int(logits[j, len(ids) - 1].argmax()) for j, ids in enumerate(inputs)]
            for i, token in zip(list(live), following):
                if token == self.tokenizer.eos_token_id:
                    live.remove(i)
                    continue
                rows[i].append(token)
                made[i].append(token)
                if any(stop in self.tokenizer.decode(made[i]) for stop in until):
                    live.remove(i)
        return [cut(self.tokenizer.decode(ids), until) for ids in made]


def cut(text: str, until: list[str]) -> str:
    """`text` up to its first stop string."""
    for stop in until:
        if stop:
            text = text.split(stop, 1)[0]
    return text


def run_tasks(model, tokenizer, tasks: Sequence, frame: Sequence[int], limit: int | None = None,
              batch_size: int = 8, include_path: Sequence[str] = (), defaults: bool = False, manager=None) -> dict:
    """lm-eval's results (JSON-serialisable) of `tasks` (registered names, paths of task YAML files, or loaded
    Task objects) on the model. lm-eval finds names through `manager`, else through a TaskManager of
    `include_path` (folders of task YAMLs) and, with `defaults`, lm-eval's own tasks (indexing them takes
    seconds)."""
    manager = manager or TaskManager(include_path=list(include_path) or None, include_defaults=defaults)
    results = simple_evaluate(model=UltraThinkLM(model, tokenizer, frame, batch_size), tasks=list(tasks),
                              task_manager=manager, limit=limit, bootstrap_iters=BOOTSTRAP_ITERS,
                              log_samples=False)
    return json.loads(json.dumps(results, default=handle_non_serializable))
