"""The fine-tune stage on several ranks (launch.nproc_per_node 2: gloo ranks the stage starts itself): LoRA under DDP
and FSDP takes the steps one process takes with the same params — the same global batch of pairs, each rank its half,
every answer token weighing the same however the batch is split (answers here differ in length) — and the main
rank merges the adapters into the same plain model. (`dvc repro` on two ranks, both stages: tests/test_scale_out.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from test_finetune import assets  # noqa: F401  (the fixture: a tiny base model and its tokenizers)

pytestmark = [pytest.mark.slow, pytest.mark.spawns]

ROOT = Path(__file__).resolve().parents[1]
# Answers of 1 to 4 sentences: a micro-batch's mean loss is over a different number of answer tokens on each rank.
PAIRS = [{"prompt": f"Where is cat {i}?", "response": f"Cat {i} sat on the mat." + " It purred." * (i % 4)}
         for i in range(48)]
LOSS_RTOL, WEIGHT_ATOL = 1e-5, 1e-5


def fine_tune(base_dir: Path, tmp: Path, ranks: int, backend: str = "auto") -> Path:
    out = tmp / f"{backend}-{ranks}"
    out.mkdir()
    (out / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    params = {
        "paths": {"finetuned_dir": str(out / "finetuned"), "finetune_report": str(out / "finetune.json"),
                  "finetune_checkpoint_dir": str(out / "ckpt"), "finetune_plan": str(out / "plan.json")},
        "train": {"precision": "fp32", "attention": "torch", "threads": 1, "log_every": 1, "backend": backend},
        "finetune": {"enabled": True, "init_from": str(base_dir / "model"), "data": str(out / "pairs.jsonl"),
                     "max_steps": 12, "batch_size": 8, "warmup_steps": 1, "eval_every": 6, "lr": 0.02,
                     "samples": 1, "lora": {"r": 4, "alpha": 8.0, "dropout": 0.0}},
        "launch": {"nproc_per_node": ranks},
    }
    (out / "params.yaml").write_text(yaml.safe_dump(params))
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{out / 'mlflow.db'}")
    done = subprocess.run([sys.executable, "-m", "tasks.finetune", "--params", str(out / "params.yaml")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return out / "finetuned"


@pytest.fixture(scope="module")
def one_process(assets, tmp_path_factory) -> Path:  # noqa: F811
    return fine_tune(assets, tmp_path_factory.mktemp("one"), 1)


@pytest.mark.parametrize("backend", ["ddp", "fsdp"])
def test_lora_on_two_ranks_takes_one_process_steps(assets, one_process, backend, tmp_path):  # noqa: F811
    two = fine_tune(assets, tmp_path, 2, backend)
    status = json.loads((two / "finetune.json").read_text())
    assert (status["world_size"], status["backend"], status["steps"]) == (2, backend, 12)
    alone = json.loads((one_process / "finetune.json").read_text())
    assert (alone["world_size"], alone["backend"]) == (1, "single")
    one, other = (json.loads((d / "model" / "history.json").read_text()) for d in (one_process, two))
    assert [h["step"] for h in one] == [h["step"] for h in other] == list(range(1, 13))
    for a, b in zip(one, other):
        assert abs(a["train_loss"] - b["train_loss"]) <= LOSS_RTOL * a["train_loss"], (a, b)
    assert abs(one[-1]["val_loss"] - other[-1]["val_loss"]) <= LOSS_RTOL * one[-1]["val_loss"]
    assert one[-1]["train_loss"] < one[0]["train_loss"] - 0.3  # it learned: the comparison is not of two no-ops
    wa, wb = (load_file(d / "model" / "model.safetensors") for d in (one_process, two))
    assert wa.keys() == wb.keys() and not any("lora" in k for k in wb)  # merged into plain weights
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < WEIGHT_ATOL
    assert status["metrics"]["ft_response_loss"] == pytest.approx(alone["metrics"]["ft_response_loss"], rel=1e-5)


def test_each_rank_reads_its_half_of_the_global_batch_and_an_odd_batch_names_the_knob(assets):  # noqa: F811
    from ultrathink.finetune.pairs import ChatBatches
    from ultrathink.model.chat import assistant, user
    from ultrathink.tokenizer import load_tokenizer
    from ultrathink.train.loader import BatchSplitError

    tokenizer = load_tokenizer(assets / "chat")
    chats = [[user(p["prompt"]), assistant(p["response"])] for p in PAIRS]
    whole = ChatBatches(tokenizer, chats, 48, 8, seed=3)
    halves = [ChatBatches(tokenizer, chats, 48, 8, seed=3, rank=r, world_size=2) for r in (0, 1)]
    for _ in range(7):  # across the epoch boundary (48 pairs, 8 per step)
        x, y = next(whole)
        parts = [next(h) for h in halves]
        assert torch.equal(torch.cat([p[0] for p in parts]), x) and torch.equal(torch.cat([p[1] for p in parts]), y)
    with pytest.raises(BatchSplitError, match=r"global batch of 7 sequences \(finetune.batch_size 7\) cannot be "
                                              r"split evenly over 2 ranks"):
        ChatBatches(tokenizer, chats, 48, 7, seed=3, rank=0, world_size=2)


def test_what_cannot_fine_tune_on_several_ranks_is_refused_with_the_way_out(assets, tmp_path):  # noqa: F811
    from ultrathink.config import Params
    from ultrathink.errors import StageError
    from ultrathink.finetune.sft import Base, ShardedQuantizedError, build
    from ultrathink.stages import finetune
    from ultrathink.train.distributed import Distributed

    params = Params(train={"backend": "deepspeed"}, launch={"nproc_per_node": 2},
                    finetune={"enabled": True, "init_from": str(assets / "model")})
    with pytest.raises(StageError, match=r"train.backend is deepspeed: set it for the fine-tune "
                                         r"\(--set train.backend=ddp\)"):
        finetune.run(params)  # before any rank starts
    quantized = Params(paths={"finetune_checkpoint_dir": str(tmp_path / "ckpt")},
                       finetune={"quantize": "int8", "init_from": str(assets / "model")})
    base = Base("dir", str(assets / "model"), assets / "model", assets / "tokenizer", "sha")
    with pytest.raises(ShardedQuantizedError, match="finetune.quantize int8 cannot be sharded by FSDP.*train.backend ddp"):
        build(quantized, base, None, [], [], Distributed(rank=0, world_size=2, backend="fsdp"))
