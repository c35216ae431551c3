"""The files of an engine's checkpoints, the same for every engine.

A checkpoint written by `Engine.save` is a Hugging Face directory (checked tensor by tensor before
it is loaded: `check_hf_checkpoint`), written atomically, with TRAIN_STATE beside the weights. A
resumable one (`Engine.save_resumable`) holds, beside its Hugging Face files, SHARDED_STATE (each
rank's shards, written with `torch.distributed.checkpoint`), RANK_RNG per rank and RESUMABLE_META.
`SavedLayout` lets the trainer write the generation servers' weights every step without
`save_pretrained`'s per-call cost.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from areal_flow.runtime import run_dir as rd
from areal_flow.runtime.disk import torch_save
from areal_flow.training.engine import CheckpointError

TRAIN_STATE, SHARDED_STATE, RESUMABLE_META, RANK_RNG = rd.TRAIN_STATE, rd.SHARDED_STATE, rd.RESUMABLE_META, rd.RANK_RNG
"""A checkpoint's files beside its Hugging Face files (runtime/run_dir.py says what each holds)."""


def read_train_state(path: str) -> dict | None:
    """The TRAIN_STATE beside a checkpoint's weights, or None when it has none."""
    state_file = os.path.join(path, TRAIN_STATE)
    if not os.path.exists(state_file):
        return None
    try:
        return torch.load(state_file, weights_only=True)  # a checkpoint cannot run code
    except Exception as exc:
        raise CheckpointError(f"{state_file}: unreadable training state: {exc}") from exc


def _read_small(file: str) -> dict:
    try:
        return torch.load(file, weights_only=True)  # a checkpoint cannot run code
    except FileNotFoundError:
        raise CheckpointError(f"{file}: missing (not a resumable checkpoint written by save_resumable)") from None
    except Exception as exc:
        raise CheckpointError(f"{file}: unreadable: {exc}") from exc


def read_resumable_meta(path: str, engine: str) -> dict:
    """RESUMABLE_META of the resumable checkpoint `path`, checked to have been written by `engine`
    with its SHARDED_STATE present; else a CheckpointError naming the file."""
    meta = _read_small(os.path.join(path, RESUMABLE_META))
    if meta.get("engine") != engine:
        raise CheckpointError(f"{os.path.join(path, RESUMABLE_META)}: written by the {meta.get('engine')} engine, "
                              f"this is the {engine} engine")
    if not os.path.isfile(os.path.join(path, SHARDED_STATE, ".metadata")):
        raise CheckpointError(f"{os.path.join(path, SHARDED_STATE)}: no .metadata (an incomplete sharded state)")
    return meta


def read_rank_rng(path: str, rank: int) -> dict:
    return _read_small(os.path.join(path, RANK_RNG.format(rank=rank)))


def write_sharded_state(path: str, state: dict, group: dist.ProcessGroup | None, alone: bool) -> None:
    """`state` into SHARDED_STATE under `path` with `torch.distributed.checkpoint`: each rank of
    `group` (None: the default one) writes the shards it holds, rank 0 the index (`.metadata`).
    `alone`: this process is the only rank (no process group needed)."""
    import torch.distributed.checkpoint as dcp

    folder = os.path.join(path, SHARDED_STATE)
    os.makedirs(folder, exist_ok=True)
    with warnings.catch_warnings():  # one process alone is what `alone` says; DCP warns of it
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=folder, process_group=group, no_dist=alone)


def read_sharded_state(path: str, state: dict, group: dist.ProcessGroup | None, alone: bool) -> None:
    """Load SHARDED_STATE under `path` into `state` in place (each rank reads the parts of the
    files its tensors cover: DCP reshards). Check it first with `check_sharded_state`."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=os.path.join(path, SHARDED_STATE), process_group=group, no_dist=alone)


def check_sharded_state(path: str, state: dict) -> None:
    """Fail naming the tensor when the SHARDED_STATE at `path` lacks one of the tensors of `state`
    (a nested state dict as `torch.distributed.checkpoint.load` takes it) or holds it in another
    shape, before anything is loaded: `load` copies into the model's own tensors as it goes."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    folder = os.path.join(path, SHARDED_STATE)
    try:
        saved = FileSystemReader(folder).read_metadata().state_dict_metadata
    except Exception as exc:
        raise CheckpointError(f"{folder}: unreadable sharded state: {exc}") from exc

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)
        elif isinstance(value, torch.Tensor):
            shape = tuple(value.shape)  # a DTensor's shape is its global one
            found = saved.get(prefix)
            if not isinstance(found, TensorStorageMetadata):
                raise CheckpointError(f"{folder}: tensor {prefix} is missing")
            if tuple(found.size) != shape:
                raise CheckpointError(f"{folder}: tensor {prefix} has shape {list(found.size)}, this model wants "
                                      f"{list(shape)}")

    walk("", state)


def require_config(path: str) -> None:
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise CheckpointError(f"{path}: no config.json (not a Hugging Face model directory)")


def check_hf_checkpoint(path: str, expected: dict[str, tuple[int, ...]], optional: tuple[str, ...] = ()) -> set[str]:
    """Fail with the file or tensor at fault when `path` does not hold exactly the tensors
    `expected` (Hugging Face name -> shape). `from_pretrained` alone would initialise a missing
    tensor at random with only a warning, and a wrong shape fails deep inside it. Names starting
    with one of `optional` may be absent (a value head the caller initialises). Returns the names
    the checkpoint holds."""
    from safetensors import safe_open

    require_config(path)
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors weight file")
    found: dict[str, tuple[tuple[int, ...], str]] = {}
    for name in files:
        try:
            with safe_open(os.path.join(path, name), framework="pt") as f:
                for key in f.keys():
                    found[key] = (tuple(f.get_slice(key).get_shape()), name)
        except Exception as exc:  # safetensors raises its own error types for a truncated file
            raise CheckpointError(f"{path}/{name}: unreadable safetensors file: {exc}") from exc
    missing = sorted(k for k in set(expected) - set(found) if not k.startswith(optional))
    if missing:
        raise CheckpointError(f"{path}: tensor {missing[0]} is missing" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    for key, shape in expected.items():
        if key in found and found[key][0] != tuple(shape):
            raise CheckpointError(f"{path}/{found[key][1]}: tensor {key} has shape {list(found[key][0])}, "
                                  f"the model's config wants {list(shape)}")
    return set(found)


def atomic_write_dir(path: str, write: Callable[[str], None]) -> None:
    """Runs write(tmp_dir) and moves tmp_dir to `path`; on any failure removes tmp_dir and re-raises.

    A failure leaves `path` as it was (absent, or the previous checkpoint). Replacing an existing
    directory takes two renames, so a reader racing the swap can briefly find nothing: publish to a
    new path per version when readers poll.
    """
    path = os.path.abspath(path)
    parent, name = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)
    os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; a server running as another user must read it
    old = None
    try:
        write(tmp)
        if os.path.exists(path):
            old = tempfile.mkdtemp(prefix=f".{name}.old-", dir=parent)
            os.rmdir(old)  # only the unique name is wanted: rename needs the target to not exist
            os.rename(path, old)
        os.rename(tmp, path)
    except BaseException:
        if old is not None and not os.path.exists(path):
            os.rename(old, path)  # put the previous checkpoint back
            old = None
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True)
class SavedLayout:
    """What `save_pretrained` wrote for a model's weights, to write the same directory again
    without it: the bytes of every other file (config.json, generation_config.json) and the weight
    file's metadata. The config does not change while training; only the tensors do."""

    files: dict[str, bytes]
    metadata: dict[str, str] | None


def saved_layout(path: str, names: Sequence[str]) -> SavedLayout | None:
    """The layout of the Hugging Face directory `path` if its weights are one file holding exactly
    the tensors `names` (the model's own parameter names) and the rest are plain files; None
    otherwise: sharded, or renamed on saving (transformers converts some architectures' tensors
    back to their original checkpoint names, e.g. Mixtral's fused experts)."""
    from safetensors import safe_open

    weights = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights):
        return None
    with safe_open(weights, framework="pt") as f:
        if sorted(f.keys()) != sorted(names):
            return None
        metadata = f.metadata()
    files = {}
    for name in os.listdir(path):
        full = os.path.join(path, name)
        if name == WEIGHTS_FILE:
            continue
        if not os.path.isfile(full):
            return None
        with open(full, "rb") as f:
            files[name] = f.read()
    return SavedLayout(files, metadata)


def write_like(tmp: str, layout: SavedLayout, state: dict[str, torch.Tensor]) -> None:
    """Write `state` into the directory `tmp` as `save_pretrained` wrote the directory of `layout`."""
    from safetensors.torch import save_file

    save_file({name: t.contiguous() for name, t in state.items()}, os.path.join(tmp, WEIGHTS_FILE),
              metadata=layout.metadata)
    for name, data in layout.files.items():
        with open(os.path.join(tmp, name), "wb") as f:
            f.write(data)


def write_hf_files(folder: str, write_weights: Callable[[str], None], tokenizer=None,
                   train_state: dict | None = None) -> None:
    """Into the existing `folder`: the weights (`write_weights(folder)` writes them and the model's
    config), the tokenizer's files when given, and TRAIN_STATE when given. Wrapped in
    `atomic_write_dir` for `Engine.save`; in place for a resumable checkpoint, whose folder the
    caller renames once complete."""
    write_weights(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    if train_state is not None:
        torch_save(train_state, os.path.join(folder, TRAIN_STATE))
