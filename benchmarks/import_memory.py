"""Peak memory of importing a ~1B-parameter Hugging Face Llama checkpoint with UltraThink's reader
(`UltraThink.from_pretrained(dir)`: a config.json of model_type llama, built on the meta device, the tensors read
with safetensors (pread) shard by shard and assigned, in their stored dtype), beside transformers'
`AutoModelForCausalLM.from_pretrained(dir, dtype=torch.bfloat16)` on the same files. The issue's goal: the import
peaks below 1.3x the weights' bytes.

The checkpoint is random, TinyLlama-1.1B's shape (hidden 2048, intermediate 5632, 22 layers, 32 heads, 4 KV heads,
vocab 32000, untied head: 1.1B parameters, 2.2 GB in bf16), written by transformers in a child process (built
directly in bf16, never in fp32) twice: sharded (`max_shard_size`, model.safetensors.index.json) and as one file.
Every import runs in a fresh child process of its own, from a cold page cache (the checkpoint's pages are dropped
with posix_fadvise before each; --warm keeps them).

What is counted: RSS is every resident page the process maps — its own (anonymous) memory *and* the pages of
mapped files it has touched, such as a safetensors file's memory map (RssFile; those pages are the page cache's,
shared with other processes and reclaimable, but resident in this process while mapped). The page cache of files
read without a mapping is not counted. Peak RSS is the kernel's high-water mark (VmHWM, what ru_maxrss reports),
reset after the imports of torch and the loader (/proc/self/clear_refs), so it is the peak of what follows.
Each import is measured at three points: when the load call returns; after every page of every weight has been
read once (what any use of the model does: a forward, a generation); and through a forward on 8 tokens.

    .venv/bin/python benchmarks/import_memory.py [--dir DIR] [--keep] [--layers 22] [--shard-size 500MB]
        [--skip-single] [--skip-transformers] [--warm]

--dir reuses (or writes, and keeps) a checkpoint directory holding sharded/ and single/; by default one is written
under /tmp and deleted at the end unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9
SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=32, num_key_value_heads=4,
             vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=False)  # TinyLlama-1.1B
TOKENS = [1, 450, 4996, 17354, 1701, 432, 17204, 975]
GOAL = 1.3


# ---------------------------------------------------------------------------------------------- in the children

def status() -> dict[str, int]:
    """This process's memory from /proc/self/status, in bytes: VmRSS = RssAnon + RssFile + RssShmem; VmHWM its peak."""
    text = Path("/proc/self/status").read_text()
    return {key: int(re.search(rf"^{key}:\s+(\d+) kB", text, re.M).group(1)) * 1024
            for key in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM")}


def reset_peak() -> bool:
    """Start VmHWM afresh from the current RSS (Linux ≥ 4.0); False where the kernel refuses."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def file_mapped_bytes(tensors) -> int:
    """Bytes of these tensors' storages that lie in a memory map of a .safetensors file (/proc/self/maps)."""
    maps = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].endswith(".safetensors"):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            maps.append((start, end))
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(n for ptr, n in storages.items() if any(a <= ptr < b for a, b in maps))


def child_build(directory: Path, layers: int, shard_size: str, single: bool) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    started = time.perf_counter()
    config = LlamaConfig(num_hidden_layers=layers, **SHAPE)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # created in bf16: no fp32 copy
    built = time.perf_counter() - started
    model.save_pretrained(directory / "sharded", max_shard_size=shard_size)
    if single:
        model.save_pretrained(directory / "single", max_shard_size="100GB")
    return {"params": sum(p.numel() for p in model.parameters()), "build_s": built,
            "seconds": time.perf_counter() - started, "peak": status()["VmHWM"]}


def child_measure(loader: str, directory: Path, logits_out: Path) -> dict:
    import torch

    if loader == "ultrathink":
        from ultrathink.model import UltraThink

        def load():
            return UltraThink.from_pretrained(directory)

        def forward(model, idx):
            return model(idx).logits
    else:
        from transformers import AutoModelForCausalLM, LlamaForCausalLM  # noqa: F401 (the modeling code, imported)

        def load():
            return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).eval()

        def forward(model, idx):
            return model(input_ids=idx).logits

    facts: dict = {"baseline": status()}
    facts["peak_reset"] = reset_peak()
    started = time.perf_counter()
    model = load()
    facts["load_s"] = time.perf_counter() - started
    facts["load"] = status()
    tensors = [*model.parameters(), *model.buffers()]
    facts["param_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    facts["params"] = sum(p.numel() for p in model.parameters())
    facts["dtypes"] = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})
    facts["file_mapped"] = file_mapped_bytes(tensors)
    started = time.perf_counter()
    with torch.no_grad():
        for t in tensors:  # one element every 2 KiB: every 4 KiB page of every weight is read
            flat = t.detach().reshape(-1)
            flat[:: max(1, 2048 // t.element_size())].float().sum().item()
    facts["touch_s"] = time.perf_counter() - started
    facts["touch"] = status()
    started = time.perf_counter()
    with torch.inference_mode():
        logits = forward(model, torch.tensor([TOKENS]))
    facts["forward_s"] = time.perf_counter() - started
    facts["forward"] = status()
    facts["finite"] = bool(torch.isfinite(logits).all())
    torch.save(logits.float(), logits_out)
    return facts


# ------------------------------------------------------------------------------------------------- in the parent

def run_child(*args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True, env=env)
    results = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not results:
        raise SystemExit(f"child {args} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return json.loads(results[-1].removeprefix("RESULT "))


def weight_files(checkpoint: Path) -> list[Path]:
    return sorted(checkpoint.glob("*.safetensors"))


def evict(checkpoint: Path) -> None:
    """Drop the checkpoint's pages from the page cache (written back first), so the import reads the disk."""
    for path in weight_files(checkpoint):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def row(loader: str, variant: str, checkpoint: Path, work: Path, warm: bool) -> dict:
    if not warm:
        evict(checkpoint)
    logits = work / "logits" / f"{loader}-{variant}.pt"
    logits.parent.mkdir(exist_ok=True)
    facts = run_child("measure", loader, str(checkpoint), str(logits))
    return {"loader": loader, "variant": variant, "logits": logits, **facts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=None, help="checkpoint directory to reuse or write (kept)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint written under /tmp")
    parser.add_argument("--layers", type=int, default=22, help="num_hidden_layers (22: TinyLlama-1.1B)")
    parser.add_argument("--shard-size", default="500MB", help="max_shard_size of the sharded variant")
    parser.add_argument("--skip-single", action="store_true", help="only the sharded checkpoint")
    parser.add_argument("--skip-transformers", action="store_true", help="only UltraThink's reader")
    parser.add_argument("--warm", action="store_true", help="leave the checkpoint in the page cache between imports")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        kind, *rest = args.child
        if kind == "build":
            facts = child_build(Path(rest[0]), int(rest[1]), rest[2], rest[3] == "1")
        else:
            facts = child_measure(rest[0], Path(rest[1]), Path(rest[2]))
        print("RESULT " + json.dumps(facts), flush=True)
        return

    work = Path(tempfile.mkdtemp(prefix="ultrathink-import-bench-"))
    root = args.dir or work / "checkpoint"
    try:
        variants = ["sharded"] + ([] if args.skip_single else ["single"])
        if all(weight_files(root / v) for v in variants):
            print(f"checkpoint: reusing {root}")
        else:
            built = run_child("build", str(root), str(args.layers), args.shard_size, "0" if args.skip_single else "1")
            print(f"checkpoint: {built['params']:,} parameters built in bf16 in {built['build_s']:.0f} s, written in "
                  f"{built['seconds'] - built['build_s']:.0f} s to {root} (builder peak RSS "
                  f"{built['peak'] / GB:.2f} GB)")
        for v in variants:
            files = weight_files(root / v)
            print(f"  {v}: {len(files)} safetensors file(s), {sum(p.stat().st_size for p in files) / GB:.3f} GB")
        cache = "warm" if args.warm else "cold (posix_fadvise DONTNEED) before each import"
        print(f"{os.cpu_count()} cores; page cache {cache}")

        rows = []
        for variant in variants:
            for loader in ["ultrathink"] + ([] if args.skip_transformers else ["transformers"]):
                rows.append(row(loader, variant, root / variant, work, args.warm))
                r = rows[-1]
                print(f"  measured {loader} on {variant}: load {r['load_s']:.1f} s, read every weight "
                      f"{r['touch_s']:.1f} s, forward {r['forward_s']:.1f} s", flush=True)

        import torch

        reference = torch.load(rows[0]["logits"])
        weights = rows[0]["param_bytes"]
        print(f"\nweights: {weights / GB:.3f} GB ({rows[0]['params']:,} parameters, {', '.join(rows[0]['dtypes'])}); "
              f"peaks from after `import torch` and the loader's modules (the baseline), goal: import peak < "
              f"{GOAL}x the weights")
        print("\nAt import (when the load call returns):\n")
        print("| loader | checkpoint | load s | baseline RSS: anon + file GB | peak RSS GB | "
              "(peak − baseline) / weights | peak / weights | RSS then: anon + file GB | weights in a file mapping |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            base, load = r["baseline"]["VmRSS"], r["load"]
            anon, file = r["baseline"]["RssAnon"], r["baseline"]["RssFile"]
            print(f"| {r['loader']} | {r['variant']} | {r['load_s']:.1f} | {anon / GB:.2f} + {file / GB:.2f} | "
                  f"{load['VmHWM'] / GB:.2f} | "
                  f"**{(load['VmHWM'] - base) / weights:.2f}** | {load['VmHWM'] / weights:.2f} | "
                  f"{load['RssAnon'] / GB:.2f} + {load['RssFile'] / GB:.2f} | "
                  f"{r['file_mapped'] / r['param_bytes']:.0%} |")
        print("\nIn use (after every weight was read once, then through a forward on 8 tokens):\n")
        print("| loader | checkpoint | read s | RSS after reading: anon + file GB | peak RSS GB | "
              "(peak − baseline) / weights | peak / weights | forward s | peak through the forward GB | "
              "(peak − baseline) / weights | dtypes | logits finite, max abs diff to the first row |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            base, touch, fwd = r["baseline"]["VmRSS"], r["touch"], r["forward"]
            diff = (torch.load(r["logits"]) - reference).abs().max().item()
            print(f"| {r['loader']} | {r['variant']} | {r['touch_s']:.1f} | {touch['RssAnon'] / GB:.2f} + "
                  f"{touch['RssFile'] / GB:.2f} | {touch['VmHWM'] / GB:.2f} | "
                  f"**{(touch['VmHWM'] - base) / weights:.2f}** | {touch['VmHWM'] / weights:.2f} | "
                  f"{r['forward_s']:.1f} | {fwd['VmHWM'] / GB:.2f} | "
                  f"{(fwd['VmHWM'] - base) / weights:.2f} | {', '.join(r['dtypes'])} | {r['finite']}, {diff:.2g} |")
        print(f"\nlogits of the first row: max |logit| {reference.abs().max().item():.3g} (bf16)")
        if not all(r["peak_reset"] for r in rows):
            print("\n(the kernel refused to reset the peak: peaks include the imports)")
    finally:
        if args.keep and args.dir is None:
            shutil.rmtree(work / "logits", ignore_errors=True)
            print(f"\nkept: {root}")
        else:
            shutil.rmtree(work, ignore_errors=True)  # the checkpoint too, unless it is --dir's

if __name__ == "__main__":
    main()
