"""The weight routes of SGLang's native API: new weights from disk (/update_weights_from_disk),
by broadcast from the trainer over a weights group (/init_weights_update_group,
/update_weights_from_distributed, /destroy_weights_update_group; weights/group.py), or by handle
from a process on this machine (/update_weights_from_tensor; weights/ipc.py).

Each answers SGLang's `{"success", "message"}` shape, 400 with the old weights kept when refused.
`weight_version` may be any label (SGLang's is a free string); the integer version that tags
tokens follows from it (`engine.version_for_label`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from typing import Any

import torch

from areal_flow.generation.engine.generation_engine import version_for_label
from areal_flow.generation.http.bodies import json_object
from areal_flow.generation.http.context import Call, Payload, Route, Served
from areal_flow.generation.http.errors import HTTPError, as_bool, bad_request
from areal_flow.generation.http.weight_groups import WEIGHT_GROUP_TIMEOUT, WeightGroup
from areal_flow.weights import group as weight_group
from areal_flow.weights import adapter as adapter_files
from areal_flow.weights import ipc

logger = logging.getLogger(__name__)


def _weight_version(value: Any, current: int) -> tuple[int, str | None]:
    """The integer version and the label (None: unchanged) that `weight_version` asks for."""
    if value is None:
        return current + 1, None  # new weights always get a new version, so token versions tell them apart
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        value = str(value)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"weight_version must be a non-empty string (or a non-negative integer), got {value!r}")
    return version_for_label(value, current), value


async def route_update_weights(server: Served, call: Call) -> tuple[int, Payload]:
    body = json_object(call.body)
    engine = server.engine
    path = body.get("model_path")
    try:
        if not isinstance(path, str) or not path:
            raise ValueError("model_path is required: a directory with model.safetensors")
        version, label = _weight_version(body.get("weight_version"), engine.version)
        abort_all = as_bool(body.get("abort_all_requests"), "abort_all_requests", False)
        as_bool(body.get("flush_cache"), "flush_cache", True)  # the engine keeps no prefix cache to flush
        # Without abort_all_requests the update waits for the running requests to finish: on a
        # worker thread, not the event loop.
        await asyncio.to_thread(engine.update_weights_from_disk, path, version, abort_all_requests=abort_all,
                                label=label)
    except HTTPError as exc:
        return 400, {"success": False, "message": exc.message, "num_paused_requests": 0}
    except (OSError, ValueError) as exc:
        message = f"Failed to update weights: {exc}. The server keeps weight version {engine.weight_label}."
        return 400, {"success": False, "message": message, "num_paused_requests": 0}
    return 200, _loaded(engine) | {"num_paused_requests": 0}


async def route_update_weights_from_tensor(server: Served, call: Call) -> tuple[int, Payload]:
    """SGLang's /update_weights_from_tensor: tensors of a process on this machine, by handle (CUDA
    IPC on a GPU, shared-memory files on the CPU: weights/ipc.py), copied into the model before the
    answer, so the sender may free them then. One serialized bucket: the embedded engine is one TP
    rank."""
    body = json_object(call.body)
    engine = server.engine
    refused = {"success": False, "message": ""}
    try:
        buckets = body.get("serialized_named_tensors")
        if not isinstance(buckets, list) or len(buckets) != 1:
            raise bad_request("serialized_named_tensors must be a list of one serialized bucket (one per TP rank; "
                              f"the embedded engine is one), got {type(buckets).__name__}"
                              + (f" of {len(buckets)}" if isinstance(buckets, list) else ""))
        if body.get("load_format") is not None:
            raise bad_request(f"load_format {body['load_format']!r} is not supported: the embedded engine loads "
                              "Hugging Face tensors as they are (load_format null)")
        version, label = _weight_version(body.get("weight_version"), engine.version)
        abort_all = as_bool(body.get("abort_all_requests"), "abort_all_requests", False)
        as_bool(body.get("flush_cache"), "flush_cache", True)  # the engine keeps no prefix cache to flush
        lora = _lora_config(body)
        named = await asyncio.to_thread(ipc.deserialize, buckets[0])
        state = dict(named)
        await asyncio.to_thread(_load, engine, state, lora, version, abort_all_requests=abort_all,
                                source=f"tensors by handle ({len(state)} tensors)", label=label)
    except HTTPError as exc:
        return 400, refused | {"message": f"Failed to update weights: {exc.message}"}
    except ValueError as exc:
        return 400, refused | {"message": f"Failed to update weights: {exc}. The server keeps weight version "
                                          f"{engine.weight_label}."}
    return 200, _loaded(engine)


def _lora_config(body: dict) -> dict | None:
    """A request's `lora_config` (areal_flow's field: the update is LoRA adapters to merge), checked."""
    config = body.get("lora_config")
    if config is None:
        return None
    try:
        return adapter_files.check_config(config)
    except ValueError as exc:
        raise bad_request(str(exc)) from None


def _load(engine, state: dict, lora: dict | None, version: int, **kw: Any) -> None:
    """Weights into the engine, or with `lora` adapters applied to its base."""
    if lora is None:
        engine.update_weights_from_tensors(state, version, **kw)
    else:
        engine.update_adapters_from_tensors(state, lora, version, **kw)


def _loaded(engine) -> dict:
    """The answer to an update that loaded: with LoRA, the digest of the adapters it applied."""
    answer = {"success": True, "message": f"Succeeded to update model weights. Weight version updated to "
                                          f"{engine.weight_label}."}
    if engine.adapter_digest is not None:
        answer["adapter_digest"] = engine.adapter_digest
    return answer


def _off_loop(fn: Callable[..., Any], *args: Any) -> Awaitable[Any]:
    """Run `fn` on a daemon thread. A broadcast whose sender died blocks until the group's timeout;
    on a daemon thread it cannot hold up the process's exit (asyncio.to_thread's pool would)."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as exc:
            future.set_exception(exc)

    threading.Thread(target=run, name="weights-group", daemon=True).start()
    return asyncio.wrap_future(future)


def _group_field(body: dict, key: str, kind: type, default: Any = None) -> Any:
    value = body.get(key, default)
    if not isinstance(value, kind) or isinstance(value, bool) or (kind is str and not value):
        raise bad_request(f"{key} must be {'a non-empty string' if kind is str else 'an integer'}, got {value!r}")
    return value


async def route_init_weights_update_group(server: Served, call: Call) -> tuple[int, Payload]:
    """Join the weights group as rank `rank_offset` (the embedded engine is one rank: SGLang's TP
    ranks would take rank_offset + tp_rank). Returns once every rank has joined."""
    body = json_object(call.body)
    try:
        address = _group_field(body, "master_address", str)
        port = _group_field(body, "master_port", int)
        rank = _group_field(body, "rank_offset", int)
        world_size = _group_field(body, "world_size", int)
        name = _group_field(body, "group_name", str, weight_group.DEFAULT_GROUP)
        backend = _group_field(body, "backend", str, "nccl")  # SGLang's default; the embedded engine needs gloo
        if not 0 < rank < world_size:
            raise bad_request(f"rank_offset must be in [1, world_size) = [1, {world_size}): rank 0 is the "
                              f"trainer's, got {rank}")
        if backend == "nccl" and server.engine.device.type != "cuda":
            raise bad_request(f"backend 'nccl' needs the engine on CUDA, and this server runs on "
                              f"{server.engine.device.type}: join with backend 'gloo'")
        with server.weight_groups_lock:
            if name in server.weight_groups:
                raise bad_request(f"a weights group named {name!r} exists already; destroy it first "
                                  "(/destroy_weights_update_group)")
        process_group = await _off_loop(functools.partial(
            weight_group.join, None, master_address=address, master_port=port, rank=rank, world_size=world_size,
            group_name=name, backend=backend, timeout=WEIGHT_GROUP_TIMEOUT))
    except HTTPError as exc:
        return 400, {"success": False, "message": f"Failed to init the weights update group: {exc.message}"}
    except weight_group.WeightGroupError as exc:
        return 400, {"success": False, "message": f"Failed to init the weights update group: {exc}"}
    with server.weight_groups_lock:
        # NCCL broadcasts from and into GPU memory, gloo CPU memory.
        device = server.engine.device if backend == "nccl" else torch.device("cpu")
        server.weight_groups[name] = WeightGroup(name, process_group, rank, world_size, threading.Lock(), device)
    logger.info("joined weights group %r as rank %d of %d (%s, store at %s:%d)", name, rank, world_size, backend,
                address, port)
    return 200, {"success": True, "message": "Succeeded to initialize custom process group."}


async def route_update_weights_from_distributed(server: Served, call: Call) -> tuple[int, Payload]:
    """Receive one bucket by broadcast and load it. Once the bucket can be read (its group exists,
    names, dtypes and shapes are well formed) its tensors are received whatever else is wrong, so
    that the sender's broadcast completes and the group stays usable; only then is a bucket that
    does not fit the model refused, naming the tensor, with nothing of it loaded."""
    body = json_object(call.body)
    engine = server.engine
    refused = {"success": False, "message": ""}
    try:
        name = _group_field(body, "group_name", str, weight_group.DEFAULT_GROUP)
        with server.weight_groups_lock:
            group = server.weight_groups.get(name)
        if group is None:
            raise ValueError(f"no weights group named {name!r}; join one first (/init_weights_update_group)")
        specs = weight_group.parse_bucket(body.get("names"), body.get("dtypes"), body.get("shapes"))
    except HTTPError as exc:
        return 400, refused | {"message": f"Failed to update weights: {exc.message}"}
    except ValueError as exc:
        return 400, refused | {"message": f"Failed to update weights: {exc}"}

    problem, lora = "", None  # a problem found before the tensors arrive is told once they have
    try:
        version, label = _weight_version(body.get("weight_version"), engine.version)
        abort_all = as_bool(body.get("abort_all_requests"), "abort_all_requests", False)
        as_bool(body.get("flush_cache"), "flush_cache", True)  # the engine keeps no prefix cache to flush
        if body.get("load_format") is not None:
            raise bad_request(f"load_format {body['load_format']!r} is not supported: the embedded engine loads "
                              "Hugging Face tensors as they are (load_format null)")
        lora = _lora_config(body)
    except HTTPError as exc:
        problem = exc.message
    except ValueError as exc:
        problem = str(exc)

    def receive_and_load() -> str:
        """Returns why the bucket was refused, or ""."""
        with group.lock:
            try:
                state = group.receive(specs)
            except RuntimeError as exc:  # the broadcast failed: the sender left or the group timed out
                return f"receiving from group {name!r} failed: {exc}"
            if problem:
                return problem
            try:
                # Returns once the tensors are copied into the model: the buffer is free again.
                _load(engine, state, lora, version, source=f"weights group {name!r} ({len(state)} tensors)",
                      abort_all_requests=abort_all, label=label)
            except ValueError as exc:
                return str(exc)
        return ""

    if why := await _off_loop(receive_and_load):
        return 400, refused | {"message": f"Failed to update weights: {why}. The server keeps weight version "
                                          f"{engine.weight_label}."}
    return 200, _loaded(engine)


async def route_destroy_weights_update_group(server: Served, call: Call) -> tuple[int, Payload]:
    body = json_object(call.body)
    try:
        name = _group_field(body, "group_name", str, weight_group.DEFAULT_GROUP)
    except HTTPError as exc:
        return 400, {"success": False, "message": exc.message}
    with server.weight_groups_lock:
        group = server.weight_groups.pop(name, None)
    if group is None:
        return 400, {"success": False, "message": f"no weights group named {name!r}"}
    # The group's sockets close when nothing holds it; one still receiving keeps it until it is done.
    logger.info("left weights group %r", name)
    return 200, {"success": True, "message": f"Succeeded to destroy custom process group {name}."}


WEIGHT_ROUTES: dict[str, tuple[frozenset[str], Route]] = {
    "/update_weights_from_disk": (frozenset({"POST"}), route_update_weights),
    "/init_weights_update_group": (frozenset({"POST"}), route_init_weights_update_group),
    "/update_weights_from_distributed": (frozenset({"POST"}), route_update_weights_from_distributed),
    "/destroy_weights_update_group": (frozenset({"POST"}), route_destroy_weights_update_group),
    "/update_weights_from_tensor": (frozenset({"POST"}), route_update_weights_from_tensor),
}
"""Path → (methods, handler) of the weight routes (routes.ROUTES holds them with the others)."""
