"""Data parallel and sharded training on CPU: the train stage with launch.nproc_per_node 2 (gloo ranks it starts
itself) with DDP, FSDP2 and DeepSpeed ZeRO-1, 2 and 3 trains the same model as one process with the same params, a model with both
routing variants on (MoE layers with aux-loss-free bias balancing, a DRE routed block) warm-started into edge
cases: one expert that is never chosen and a routed block that keeps no token in its first steps. Every checkpoint
of a run first checks that all ranks hold the same routing state (and, under DDP and ZeRO-1/2, the same weights);
the run fails otherwise. FSDP and DeepSpeed runs resume from their own checkpoints exactly; a DDP run killed with
SIGKILL (launcher and workers) resumes to the weights of an uninterrupted run, bit for bit. A checkpoint of two DDP
or FSDP ranks resumes on one process, and one process's on two ranks, as the uninterrupted run on the new number of
ranks; DeepSpeed's refuses another number of ranks, naming both."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml
from safetensors.torch import load_file

from test_resume_kill import ROOT, tiny_project
from ultrathink.config import ModelConfig
from ultrathink.model import UltraThink

pytestmark = [pytest.mark.slow, pytest.mark.spawns]

# MoE MLPs in blocks 1 and 3, a routed (DRE) block 2: both variants, in one 4-layer model.
ROUTED = {"n_layers": 4, "moe": {"enabled": True, "every": 2, "top_k": 2, "bias_balancing": True,
                                 "bias_update_rate": 0.01},
          "dre": {"enabled": True, "every": 3, "warmup_steps": 3}}
DEAD = "blocks.1.mlp.experts.0."  # the expert the parent model never lets be chosen

# Per-rank statistics (MoE capacity and load-balancing loss, DRE score quantiles) are computed per forward and then
# summed, so two ranks of 4 sequences equal ONE process of 2 micro-batches of 4 (the same 8 windows per step, split
# the same way: train.batch_size 4 × train.grad_accum 2 on any number of ranks), not one process of batch 8 (against that, different capacity drops and per-forward losses give
# ~2e-3 relative loss and ~2e-2 weight differences after 20 steps). DDP matches it bit for bit; the other backends
# reduce in another order: the worst cases seen over FSDP and ZeRO-1/2/3 are 9.5e-8 (relative train loss), 5.7e-8
# (relative val loss), 7.4e-7 (weights), 7.5e-9 (DRE thresholds) and 0 for MoE selection biases and step counts,
# i.e. every routing decision was the same. The tolerances leave a margin over that; a near-tie in top-k routing
# that flipped would move some weights by up to ~1e-3 and fail them.
LOSS_RTOL, WEIGHT_ATOL, THRESHOLD_ATOL = 1e-5, 1e-5, 1e-6


def configure(base: Path, model: dict | None = None, **train) -> None:
    params = yaml.safe_load((base / "params.yaml").read_text())
    # A fixed attention kernel: `auto` measures afresh in every run, and runs compared across backends must not
    # differ by a close timing that picked flash in one and math in the other. Cosine, not the default WSD: WSD holds
    # the peak learning rate to the last steps, which amplifies the reduction-order rounding of ZeRO-3's flattened
    # buffers to 1.6e-5 in the weights after 20 steps (7e-7 under cosine), past WEIGHT_ATOL.
    # No weight average (train.ema_horizon 0): FSDP and DeepSpeed keep none, and the runs are compared with one
    # process's (the DDP kill test below turns it on).
    params["train"].update({"max_steps": 20, "threads": 1, "select": "last", "attention": "torch",
                            "schedule": "cosine", "ema_horizon": 0.0, **train})
    # Dropout masks are per process: the one thing data parallelism changes.
    params["model"].update({"dropout": 0.0, **ROUTED, **(model or {})})
    (base / "params.yaml").write_text(yaml.safe_dump(params))


def launch(base: Path, env: dict, *sets: str) -> subprocess.Popen:
    """The train stage on 2 ranks that it starts itself (launch.nproc_per_node), in its own session."""
    args = [sys.executable, "-m", "tasks.train", "--params", str(base / "params.yaml"), "--set",
            "launch.nproc_per_node=2", *(x for s in sets for x in ("--set", s))]
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def two_ranks(base: Path, env: dict, *sets: str) -> str:
    proc = launch(base, env, *sets)
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, output[-4000:]
    return output


def train_stage(base: Path, env: dict, on_two_ranks: bool) -> None:
    """The train stage of `base`'s params on two ranks it starts itself, or in one process."""
    if on_two_ranks:
        two_ranks(base, env)
        return
    done = subprocess.run([sys.executable, "-m", "tasks.train", "--params", str(base / "params.yaml")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]


def tracking(tmp: Path) -> dict:
    return dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{tmp / 'mlflow.db'}")


def history(base: Path) -> list[dict]:
    return json.loads((base / "model" / "history.json").read_text())


def train_summary(base: Path) -> dict:
    return json.loads((base / "model" / "train_summary.json").read_text())


def final_state(base: Path) -> dict:
    """The state.pt of the run's last checkpoint."""
    last = sorted((base / "ckpt").glob("*/step_*"))[-1]
    return torch.load(last / "state.pt", weights_only=True)


def weights(base: Path) -> dict[str, torch.Tensor]:
    return load_file(base / "model" / "model.safetensors")


@pytest.fixture(scope="module")
def parent(tmp_path_factory) -> Path:
    """A model dir to warm start from, written as a user would (save_pretrained), in which expert 0 of the MoE
    layer in block 1 is never chosen (its selection bias is -1e4, far below any router probability) and the routed
    block 2 is past its warmup with thresholds (2.0) far above every router score (~1e-3 at init): it keeps no token
    until its thresholds, halving toward the observed score quantiles each step, come down (after about 7 steps)."""
    tmp = tmp_path_factory.mktemp("parent")
    params = yaml.safe_load((tiny_project(tmp, "params") / "params.yaml").read_text())
    torch.manual_seed(0)
    model = UltraThink(ModelConfig(**{**params["model"], "dropout": 0.0, **ROUTED}), 64)
    with torch.no_grad():
        model.blocks[1].mlp.select_bias[0] = -1e4
        model.blocks[2].thresholds.fill_(2.0)
        model.blocks[2].steps.fill_(model.cfg.dre.warmup_steps)
    model.save_pretrained(tmp / "model")
    return tmp / "model"


def warm(parent: Path) -> dict:
    # No weight decay: the dead expert gets only zero gradients, so AdamW leaves it exactly as the parent had it.
    return {"init_from": str(parent), "weight_decay": 0.0, "log_every": 1, "batch_size": 4, "grad_accum": 2}


@pytest.fixture(scope="module")
def single(tmp_path_factory, parent) -> Path:
    tmp = tmp_path_factory.mktemp("single")
    base = tiny_project(tmp, "single")
    configure(base, **warm(parent))  # 2 × 4 windows per step, as two ranks of 4 read them
    train_stage(base, tracking(tmp), on_two_ranks=False)
    return base


BACKENDS = {"ddp": ("ddp", None), "fsdp": ("fsdp", None), "zero1": ("deepspeed", 1), "zero2": ("deepspeed", 2),
            "zero3": ("deepspeed", 3)}


@pytest.fixture(scope="module", params=list(BACKENDS))
def two(request, tmp_path_factory, parent):
    """The same warm-started run as `single`, with the same params, on two ranks of 4 windows each."""
    backend, stage = BACKENDS[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    base = tiny_project(tmp, request.param)
    configure(base, **warm(parent), backend=backend, **({"deepspeed": {"zero_stage": stage}} if stage else {}))
    env = tracking(tmp)
    output = two_ranks(base, env)
    if backend == "deepspeed":  # it compiled no op that training never calls (deepspeed_engine.py)
        from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

        assert ShareMemCommBuilder.NAME not in output
    return base, env, request.param


def test_two_processes_match_one_process_with_the_same_global_batch(single, two):
    base, _, name = two
    one, other = history(single), history(base)
    assert [h["step"] for h in one] == [h["step"] for h in other] == list(range(1, 21))
    for a, b in zip(one, other):
        assert abs(a["train_loss"] - b["train_loss"]) <= LOSS_RTOL * a["train_loss"], a["step"]
        assert abs(a["val_loss"] - b["val_loss"]) <= LOSS_RTOL * a["val_loss"] if "val_loss" in a else True
        # Routing figures come from statistics summed over both ranks: the same counts as one process's.
        assert all(a[k] == b[k] for k in ("dre/layer2/kept", "moe_dead_experts", "moe/layer1/max_share",
                                          "moe/layer3/max_share", "moe/layer3/dropped")), a["step"]
    wa, wb = weights(single), weights(base)
    assert wa.keys() == wb.keys() and max((wa[k] - wb[k]).abs().max().item() for k in wa) < WEIGHT_ATOL
    if name == "ddp":  # the same sums as gradient accumulation, up to halving (exact): the same bits
        assert all(torch.equal(wa[k], wb[k]) for k in wa)

    # The routing state moved from statistics summed over both ranks: the same state as one process that saw all
    # the windows (a rank that moved it from its own half would drift apart, and fail check_routing_state at
    # every checkpoint).
    for name_ in ("blocks.1.mlp.select_bias", "blocks.3.mlp.select_bias", "blocks.2.steps"):
        assert torch.equal(wa[name_], wb[name_]), name_
    assert (wb["blocks.3.mlp.select_bias"] != 0).any()  # bias balancing did move it
    assert wb["blocks.2.steps"].item() == 3 + 20  # the parent's warmup steps, then one per applied step
    assert (wa["blocks.2.thresholds"] - wb["blocks.2.thresholds"]).abs().max() < THRESHOLD_ATOL

    # Only rank 0 wrote: one configuration folder, one directory per kept checkpoint.
    (folder,) = [p for p in (base / "ckpt").iterdir() if (p / "fingerprint.json").is_file()]
    assert sorted(p.name for p in folder.glob("step_*")) == ["step_00000015", "step_00000020"]
    if name.startswith("zero"):  # each rank's ZeRO shard of the optimizer state, in DeepSpeed's own format
        shards = sorted(p.name for p in (folder / "step_00000020" / "deepspeed" / "ds").glob("*optim_states.pt"))
        assert shards == ["zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    else:  # torch engines: every rank wrote its own file of optimizer shards (sharded.py), one joined weights file
        written = sorted(p.name for p in (folder / "step_00000020").rglob("*.safetensors"))
        assert written == ["model.safetensors", "shard-00001-model-00001-of-00001.safetensors",
                           "shard-00002-model-00001-of-00001.safetensors"]
        manifest = json.loads((folder / "step_00000020" / "manifest.json").read_text())
        assert (manifest["world_size"], manifest["backend"]) == (2, name)


def test_a_dead_expert_and_a_routed_block_that_keeps_no_token_train_on_two_processes(parent, two):
    base, _, _ = two
    records = history(base)
    assert all(math.isfinite(r["train_loss"]) and math.isfinite(r["grad_norm"]) for r in records)
    assert json.loads((base / "model" / "train_summary.json").read_text())["skipped_steps"] == 0
    # Expert 0 of block 1 processed no token in any step, and the metrics say so.
    assert all(r["moe/layer1/dead"] >= 1 and r["moe_dead_experts"] >= 1 for r in records)
    # The routed block kept no token in its first steps (its block ran on padding slots only), then its
    # thresholds came down to the score quantiles and it routes about half of the tokens (path standard).
    kept = [r["dre/layer2/kept"] for r in records]
    assert kept[0] == 0 and 0.25 < kept[-1] < 0.75, kept

    # The dead expert got only zero gradients (and no weight decay): it alone is exactly the parent's; everything
    # else moved, the routed block's weights and the routing buffers included.
    before, after = load_file(parent / "model.safetensors"), weights(base)
    unchanged = sorted(k for k in before if torch.equal(before[k], after[k]))
    assert unchanged == [DEAD + "down_proj.weight", DEAD + "gate_proj.weight", DEAD + "up_proj.weight"]


def test_sharded_runs_resume_from_their_own_checkpoints(two):
    base, env, name = two
    if name == "ddp":
        pytest.skip("DDP's resume on two ranks is tested below, after SIGKILL")
    (folder,) = [p for p in (base / "ckpt").iterdir() if (p / "fingerprint.json").is_file()]
    first, records = weights(base), history(base)
    shutil.rmtree(folder / "step_00000020")
    shutil.rmtree(base / "model")
    two_ranks(base, env)
    assert json.loads((base / "train_run.json").read_text())["resumed_from"] == 15
    again = weights(base)
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
    assert [r["train_loss"] for r in records] == [r["train_loss"] for r in history(base)]


def resume_copy(base: Path, tmp: Path, env: dict, ranks: int, **train) -> subprocess.CompletedProcess:
    """`base`'s run resumed from its checkpoint at step 15 (the one at 20 removed: as if stopped after 15), in a copy
    of its checkpoints, on `ranks` processes the stage starts itself."""
    copy = tmp / "copy"
    shutil.copytree(base / "ckpt", copy / "ckpt")
    shutil.copy(base / "plan.json", copy / "plan.json")
    for last in (copy / "ckpt").glob("*/step_00000020"):
        shutil.rmtree(last)
    paths = {"checkpoint_dir": "ckpt", "model_dir": "model", "train_run": "train_run.json", "train_plan": "plan.json"}
    sets = [f"paths.{key}={copy / name}" for key, name in paths.items()] + [f"launch.nproc_per_node={ranks}"]
    sets += [f"train.{key}={value}" for key, value in train.items()]
    done = subprocess.run([sys.executable, "-m", "tasks.train", "--params", str(base / "params.yaml"),
                           *(x for s in sets for x in ("--set", s))], cwd=ROOT, env=env, capture_output=True, text=True)
    (copy / "log").write_text(done.stdout + done.stderr)
    return done


def same_run(uninterrupted: Path, resumed: Path) -> None:
    """The resumed run took the uninterrupted run's steps from 16 on, up to the reduction order of the ranks."""
    assert json.loads((resumed / "train_run.json").read_text())["resumed_from"] == 15, (resumed / "log").read_text()[-3000:] if (resumed / "log").exists() else ""
    one, other = history(uninterrupted), history(resumed)
    assert [h["step"] for h in one] == [h["step"] for h in other] == list(range(1, 21))
    for a, b in zip(one[15:], other[15:]):
        assert abs(a["train_loss"] - b["train_loss"]) <= LOSS_RTOL * a["train_loss"], a["step"]
    wa, wb = weights(uninterrupted), weights(resumed)
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < WEIGHT_ATOL


def test_a_checkpoint_resumes_on_another_number_of_ranks(single, two, tmp_path):
    """Two ranks → one process and one process → two ranks (and two DDP ranks → two FSDP ranks), at the same step
    with the same global batch and data position: the loss history from there is the uninterrupted run's on the new
    number of ranks (within 1e-5).
    DeepSpeed's per-rank ZeRO state refuses another number of ranks, naming both."""
    base, env, name = two
    backend, _ = BACKENDS[name]
    to_one = resume_copy(base, tmp_path / "to_one", env, 1)
    if backend == "deepspeed":
        assert to_one.returncode == 1
        assert "was written by DeepSpeed on 2 ranks and this run has 1" in to_one.stderr, to_one.stderr[-2000:]
        assert not (tmp_path / "to_one" / "copy" / "model").exists()
        return
    assert to_one.returncode == 0, to_one.stderr[-3000:]
    same_run(single, tmp_path / "to_one" / "copy")
    to_two = resume_copy(single, tmp_path / "to_two", env, 2, backend=backend)
    assert to_two.returncode == 0, to_two.stderr[-3000:]
    same_run(base, tmp_path / "to_two" / "copy")
    summary = json.loads((tmp_path / "to_two" / "copy" / "model" / "train_summary.json").read_text())
    assert (summary["world_size"], summary["backend"]) == (2, backend)
    if backend == "ddp":  # and onto another backend: two DDP ranks' checkpoint resumed by two FSDP ranks
        to_fsdp = resume_copy(base, tmp_path / "to_fsdp", env, 2, backend="fsdp")
        assert to_fsdp.returncode == 0, to_fsdp.stderr[-3000:]
        same_run(single, tmp_path / "to_fsdp" / "copy")  # FSDP on 2 ranks takes one process's steps (test above)


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL the stage and its ranks at once, as a lost node or the OOM killer would. The elastic launcher starts
    each rank in a session of its own, so killing the stage's process group alone would leave them training."""
    workers = psutil.Process(proc.pid).children(recursive=True)
    os.killpg(proc.pid, signal.SIGKILL)
    for worker in workers:
        try:
            os.killpg(worker.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    gone, alive = psutil.wait_procs(workers, timeout=30)
    assert not alive, f"workers survived SIGKILL: {alive}"


def test_two_processes_sigkilled_then_resumed_are_bitwise_identical(tmp_path):
    """DDP, both routing variants from a cold start (DRE warmup, then routing), dropout on: the resumed ranks
    restore their own generators, so every dropout mask after the checkpoint is the uninterrupted run's."""
    steps = 40

    def project(name: str) -> Path:
        base = tiny_project(tmp_path, name)
        configure(base, model={"dropout": 0.1}, batch_size=4, backend="ddp", max_steps=steps, ema_horizon=None)
        return base

    env = tracking(tmp_path)
    straight = project("straight")
    two_ranks(straight, env)

    killed = project("killed")
    proc = launch(killed, env)
    deadline = time.monotonic() + 240
    while not any((killed / "ckpt").glob("*/step_00000010")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    kill_job(proc)
    assert proc.returncode == -signal.SIGKILL
    assert not (killed / "model").exists(), "the run finished before it could be killed"

    output = two_ranks(killed, env)
    assert "resumed from" in output
    resumed = json.loads((killed / "train_run.json").read_text())["resumed_from"]
    assert 10 <= resumed < steps

    a, b = weights(straight), weights(killed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # The weight average (train.ema_horizon null: on under DDP) went through the kill in the checkpoints' state.
    assert train_summary(straight)["averaged"] == train_summary(killed)["averaged"]
    assert all(final_state(base)["average"] is not None for base in (straight, killed))
    assert [r["train_loss"] for r in history(straight)] == [r["train_loss"] for r in history(killed)]
    assert b["blocks.2.steps"].item() == steps and (b["blocks.1.mlp.select_bias"] != 0).any()


VARIANTS = {"moe": {"dre": {"enabled": False}}, "dre": {"moe": {"enabled": False}}}


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant_single(request, tmp_path_factory) -> tuple[str, Path]:
    """One variant alone (MoE, or DRE), cold start, in one process of 2 micro-batches of 4."""
    tmp = tmp_path_factory.mktemp(f"single-{request.param}")
    base = tiny_project(tmp, request.param)
    configure(base, model=VARIANTS[request.param], max_steps=8, batch_size=4, grad_accum=2, log_every=1,
              checkpoint_every=4)
    done = subprocess.run([sys.executable, "-m", "tasks.train", "--params", str(base / "params.yaml")],
                          cwd=ROOT, env=tracking(tmp), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return request.param, base


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_each_variant_alone_trains_on_every_backend_like_one_process(variant_single, backend, tmp_path):
    variant, single_base = variant_single
    kind, stage = BACKENDS[backend]
    base = tiny_project(tmp_path, backend)
    configure(base, model=VARIANTS[variant], max_steps=8, batch_size=4, grad_accum=2, log_every=1,
              checkpoint_every=4, backend=kind, **({"deepspeed": {"zero_stage": stage}} if stage else {}))
    two_ranks(base, tracking(tmp_path))
    one, two = history(single_base), history(base)
    assert [h["step"] for h in one] == [h["step"] for h in two] == list(range(1, 9))
    figure = "moe_entropy" if variant == "moe" else "dre_kept"
    for a, b in zip(one, two):
        assert abs(a["train_loss"] - b["train_loss"]) <= LOSS_RTOL * a["train_loss"], a["step"]
        assert a[figure] == pytest.approx(b[figure], abs=1e-9), a["step"]
    wa, wb = weights(single_base), weights(base)
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < WEIGHT_ATOL


def test_a_time_budget_is_planned_once_by_rank_0_and_both_ranks_take_its_steps(tmp_path):
    """Rank 0 sizes and plans, and both ranks probe together (the probe's steps and checkpoint pay the run's
    collectives; model.dropout null: its step too, where it could pay); the plan reaches rank 1 through one
    broadcast, so both train the same steps of the same shape and dropout (DDP checks at every checkpoint that their
    weights agree). The plateau is off: this tiny corpus is read ~12 times, so where the machine is fast enough for
    a third validation it ends the run early (test_plateau_ranks tests that on two ranks)."""
    base = tiny_project(tmp_path, "budget")
    params = yaml.safe_load((base / "params.yaml").read_text())
    params["model"] = {"size": "auto", "dropout": None}
    params["train"].update({"budget": "6s", "batch_size": None, "threads": 1, "attention": "torch",
                            "checkpoint_every": 40, "eval_every": 40, "decay_patience": None})
    (base / "params.yaml").write_text(yaml.safe_dump(params))
    output = two_ranks(base, tracking(tmp_path))
    assert len(re.findall(r"plan: (?:fp32|bf16|fp16),", output)) == 1 and "model.size auto: d_model" in output
    ((machine, entry),) = json.loads((base / "plan.json").read_text()).items()
    (plan,) = entry["plans"].values()
    assert machine.startswith("cpu/") and plan["machine"] == machine and plan["probe"]["ranks"] == 2
    summary = json.loads((base / "model" / "train_summary.json").read_text())
    assert summary["steps"] == plan["max_steps"] > 0 and summary["plan"]["shape"] == plan["sizing"]["shape"]
    # The global batch is batch_size sequences on any number of ranks (half on each here).
    shape = plan["sizing"]["shape"]
    assert plan["tokens_per_step"] == plan["sizing"]["batch_size"] * shape["seq_len"]
    config = json.loads((base / "model" / "config.json").read_text())["model"]
    assert {k: config[k] for k in shape} == shape and config["dropout"] == plan["sizing"]["dropout"]
