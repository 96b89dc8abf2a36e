"""Model and optimizer state in and out of checkpoints through torch.distributed.checkpoint (DCP), for the torch
engines (one process, DDP, FSDP2), in a form that does not depend on the number of ranks.

- The optimizer state is keyed by parameter name (`<optimizer>.<parameter>.<state>`, e.g. `0.blocks.1.mlp.up.weight
  .exp_avg`) and written by every rank, each its own shards (under FSDP its slice of each tensor; replicated tensors
  by one rank), into `optimizer/shard-<rank>-*.safetensors`. The param groups (learning rates, names) are plain
  values and travel in state.pt.
- The weights are one plain `model.safetensors`. Under FSDP each rank writes its slices and the main rank joins
  the files into it, a slice at a time (join_shards): no rank ever holds the whole model.
- Loading reads each rank's own slices of every tensor (safetensors' lazy slices), whatever the number or layout of
  the ranks that wrote them: a checkpoint of 2 FSDP ranks resumes on 1 process, on DDP or on 4 FSDP ranks.

Everything is safetensors: DCP's default format would pickle its metadata and any non-tensor value, and a
checkpoint must never be unpickled (HuggingFaceStorageReader reads the offsets from the safetensors headers).
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import struct
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from collections.abc import Callable, Iterable

from safetensors import safe_open
from torch.futures import Future
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint._hf_utils import (CUSTOM_METADATA_KEY, DCP_VERSION_KEY, FORMAT_KEY, FORMAT_VALUE,
                                                    HF_DCP_VERSION, SAVED_OFFSETS_KEY, _gen_file_name)
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from ultrathink.model.model import WEIGHTS_FILE

OPTIMIZER_DIR = "optimizer"
_PARTS = "weights.parts"  # the ranks' files of the weights, until they are joined into model.safetensors
_SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                       torch.uint8: "U8", torch.bool: "BOOL"}


@contextlib.contextmanager
def _quiet_if_single():
    """DCP warns on every call in one process that it assumes one process; that is what we asked for."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*assuming the intent is", category=UserWarning)
        yield


class StreamingWriter(HuggingFaceStorageWriter):
    """HuggingFaceStorageWriter(save_distributed=True) — each rank its own safetensors file with DCP's sharding
    offsets in the header, which HuggingFaceStorageReader reads — written a tensor at a time. torch's own writer
    serializes the whole file to bytes first (safetensors.torch.save), a second copy of the rank's shard in memory
    at every checkpoint (benchmarks/checkpoint_memory.py)."""

    def __init__(self, path: Path):
        super().__init__(str(path), save_distributed=True)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results = []
        if plan.items:
            name = _gen_file_name(1, 1, plan.storage_data["shard_index"])
            results = _write_plan(Path(self.path) / name, plan, planner)
        done: Future = Future()
        done.set_result(results)
        return done


def _write_plan(path: Path, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
    """This rank's items of a DCP save plan into one safetensors file, streamed."""
    tensors, sharding = [], {}
    for item in plan.items:
        fqn = item.index.fqn
        if item.type == WriteItemType.BYTE_IO:  # DCP would pickle it: a checkpoint holds tensors only
            raise TypeError(f"{fqn} is not a tensor; a checkpoint holds tensors only")
        if fqn in sharding:
            raise ValueError(f"{fqn}: two chunks on one rank")
        chunk = item.tensor_data.chunk
        sharding[fqn] = {SAVED_OFFSETS_KEY: list(chunk.offsets)}
        tensors.append((fqn, item.tensor_data.properties.dtype, list(chunk.sizes),
                        lambda item=item: [planner.resolve_data(item)]))
    metadata = {CUSTOM_METADATA_KEY: json.dumps(sharding), DCP_VERSION_KEY: str(HF_DCP_VERSION),
                FORMAT_KEY: FORMAT_VALUE}
    spans = write_safetensors(path, tensors, metadata)
    return [WriteResult(item.index, end - start, _StorageInfo(path.name, start, end - start))
            for item, (start, end) in zip(plan.items, spans)]


def write_safetensors(path: Path, tensors: list[tuple[str, torch.dtype, list[int], Callable[[], Iterable[torch.Tensor]]]],
                      metadata: dict[str, str]) -> list[tuple[int, int]]:
    """A safetensors file of `tensors` — (name, dtype, shape, pieces: a callable giving its contiguous pieces in
    order) — with only one piece in memory at a time; each tensor's (start, end) byte offsets in the file."""
    header, offset = {}, 0
    for name, dtype, shape, _ in tensors:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps({**header, "__metadata__": metadata}, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    data_start = 8 + len(encoded)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded)
        for name, dtype, shape, pieces in tensors:
            for piece in pieces():
                f.write(piece.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
        if f.tell() != data_start + offset:
            raise ValueError(f"{path}: wrote {f.tell() - data_start} bytes of data for {offset}")
    return [(data_start + h["data_offsets"][0], data_start + h["data_offsets"][1]) for h in header.values()]


# `alone`: a one-process run, which saves and loads with no collective (no process group need exist).


def _save(state: dict, writer, alone: bool) -> None:
    with _quiet_if_single():
        dcp.save(state, storage_writer=writer, no_dist=alone)


def _load(state: dict, directory: Path, alone: bool) -> None:
    with _quiet_if_single():
        dcp.load(state, storage_reader=HuggingFaceStorageReader(str(directory)), no_dist=alone)


def save_optimizers(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], directory: Path,
                    alone: bool) -> None:
    """Write every optimizer's tensor state under `directory`/optimizer (collective)."""
    tensors = {}
    for index, opt in enumerate(optimizers):
        for name, values in get_optimizer_state_dict(model, opt)["state"].items():
            for key, value in values.items():
                if not isinstance(value, torch.Tensor):
                    raise TypeError(f"optimizer {index}: state {key!r} of {name} is not a tensor")
                tensors[f"{index}.{name}.{key}"] = value
    _save(tensors, StreamingWriter(directory / OPTIMIZER_DIR), alone)


def optimizer_groups(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> list[list[dict]]:
    """The optimizers' param groups, parameters by name: plain values, for state.pt."""
    return [get_optimizer_state_dict(model, opt)["param_groups"] for opt in optimizers]


def load_optimizers(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], directory: Path,
                    groups: list[list], alone: bool) -> None:
    """Read the optimizers' state that save_optimizers wrote, each rank its own slices, with the param groups
    optimizer_groups gave (collective)."""
    states = [get_optimizer_state_dict(model, opt) for opt in optimizers]  # the layout to fill (state created)
    tensors = {f"{index}.{name}.{key}": value for index, state in enumerate(states)
               for name, values in state["state"].items() for key, value in values.items()}
    _load(tensors, directory / OPTIMIZER_DIR, alone)
    for index, (opt, state) in enumerate(zip(optimizers, states)):
        filled = {name: {key: tensors[f"{index}.{name}.{key}"] for key in values}
                  for name, values in state["state"].items()}
        set_optimizer_state_dict(model, opt, {"state": filled, "param_groups": groups[index]})


def save_weights_from_shards(model: torch.nn.Module, directory: Path, is_main: bool) -> None:
    """`directory`/model.safetensors written from the ranks' shards of a sharded model (collective): every rank
    writes its own file, then the main rank joins them (join_shards) and removes them."""
    parts = directory / _PARTS
    _save(get_model_state_dict(model), StreamingWriter(parts), alone=False)
    dist.barrier()  # every rank's file is written
    if is_main:
        join_shards(parts, directory / WEIGHTS_FILE)
        shutil.rmtree(parts)


def join_shards(parts: Path, out: Path) -> None:
    """One plain safetensors file from the per-rank files of StreamingWriter, streamed: one rank's slice of one
    tensor in memory at a time. FSDP2 shards along the first dimension, so a tensor's bytes are its slices' bytes in
    order. (torch's own consolidation does this too, but fails on integer tensors such as the DRE step counts:
    torch.finfo of an integer dtype.)"""
    metadata = HuggingFaceStorageReader(str(parts)).read_metadata()
    tensors = []
    for name in sorted(metadata.state_dict_metadata):
        tensor = metadata.state_dict_metadata[name]
        chunks = sorted(tensor.chunks, key=lambda c: tuple(c.offsets))
        rows = 0
        for chunk in chunks:  # slices of the first dimension, each whole in the others, end to end
            if list(chunk.offsets[1:]) != [0] * (len(tensor.size) - 1) or list(chunk.sizes[1:]) != list(tensor.size[1:]) \
                    or (len(tensor.size) and chunk.offsets[0] != rows):
                raise ValueError(f"{name}: shards are not whole slices of its first dimension")
            rows += chunk.sizes[0] if len(tensor.size) else 1
        if rows != (tensor.size[0] if len(tensor.size) else 1):
            raise ValueError(f"{name}: its shards cover {rows} of its {tensor.size[0]} rows")
        files = [metadata.storage_data[MetadataIndex(name, c.offsets)].relative_path for c in chunks]
        tensors.append((name, tensor.properties.dtype, list(tensor.size),
                        lambda name=name, files=files: (_read(file, name) for file in files)))
    write_safetensors(out, tensors, {"format": "pt"})


def _read(file: str, name: str) -> torch.Tensor:
    with safe_open(file, framework="pt") as shard:
        return shard.get_tensor(name)


def load_weights(model: torch.nn.Module, directory: Path, alone: bool) -> None:
    """`directory`/model.safetensors into `model`, each rank reading its own slices (collective)."""
    state = get_model_state_dict(model)
    _load(state, directory, alone)
    set_model_state_dict(model, state)
