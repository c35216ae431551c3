"""The weights group: a process group of trainer rank 0 and every generation server, apart from the
trainers' own, over which new weights are broadcast (`rollout.weight_update_mode: distributed`).

SGLang's API for it: `POST /init_weights_update_group` {master_address, master_port, rank_offset,
world_size, group_name, backend} makes a server join with rank `rank_offset` (+ its TP rank), the
trainer being rank 0, which holds the rendezvous store; `POST /update_weights_from_distributed`
{names, dtypes, shapes, group_name, ...} announces one bucket, whose tensors rank 0 then broadcasts
one by one in that order. docs/architecture.md ("Weight updates") has the whole sequence.

The group is built from torch's public classes (a TCPStore, PrefixStores, ProcessGroupGloo or
ProcessGroupNCCL), not with `init_process_group`, which a process may call only once and which the
trainer ranks already use for their own group. Its store keys are laid out as SGLang's
`init_custom_process_group` lays them out through torch's group helper, so a real SGLang server
and this side find each other.
"""

from __future__ import annotations

import datetime
import math
import socket
from collections.abc import Sequence

import torch
import torch.distributed as dist

DEFAULT_GROUP = "weight_update_group"
"""SGLang's default `group_name`."""

BACKENDS = {"cpu": "gloo", "cuda": "nccl"}
"""The backend of the group for the devices the weights live on (cluster.device_type)."""


class WeightGroupError(RuntimeError):
    """A group cannot be made or used; the message says which and why."""


def group_store(store: dist.Store, group_name: str, backend: str) -> dist.Store:
    """The store a group's backend rendezvouses in. SGLang's custom group prefixes the rendezvous
    store with the group name and hands it to torch's group helper, which prefixes it again with
    `{group_name}/` and then with the device of the backend (`cpu/` for gloo, `cuda/` for nccl).
    The same keys here let either end be real SGLang or areal_flow."""
    device = "cuda" if backend == "nccl" else "cpu"
    return dist.PrefixStore(f"{device}/", dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store)))


def master_store(master_address: str, world_size: int, timeout: float) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free port (`.port`); it waits for nobody here: the group's
    backend does, when rank 0 joins (`join`)."""
    return dist.TCPStore(master_address, 0, world_size, is_master=True,
                         timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False)


def route_address(peer: str) -> str:
    """This host's address on the route to `peer` (the source address the kernel would use; a UDP
    socket's connect sends nothing)."""
    family = socket.AF_INET6 if ":" in peer else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((peer, 9))
        return s.getsockname()[0]


def join(store: dist.Store | None, *, master_address: str, master_port: int, rank: int, world_size: int,
         group_name: str, backend: str, timeout: float) -> dist.ProcessGroup:
    """Join the group as `rank`: with rank 0's own `store`, or (store None) as a client of the
    store at master_address:master_port. Returns once every rank has joined; raises
    WeightGroupError naming what is wrong (a backend this build lacks, a rank out of range, no
    rendezvous within `timeout` seconds)."""
    if not 0 <= rank < world_size:
        raise WeightGroupError(f"rank {rank} is not in a group of world_size {world_size}")
    if backend not in BACKENDS.values():
        raise WeightGroupError(f"backend {backend!r} is not one of {sorted(BACKENDS.values())}")
    if backend == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
        raise WeightGroupError("backend 'nccl' needs CUDA and a torch build with NCCL; this process has neither "
                               "(on the CPU the group runs over 'gloo')")
    delta = datetime.timedelta(seconds=timeout)
    try:
        if store is None:
            store = dist.TCPStore(master_address, master_port, world_size, is_master=False, timeout=delta)
        prefixed = group_store(store, group_name, backend)
        if backend == "gloo":
            options = dist.ProcessGroupGloo._Options()
            options._timeout = delta
            # gloo's default device listens at what the host name resolves to, which another host may
            # not reach (127.0.1.1 in many /etc/hosts): listen at this host's address on the way to
            # the master's instead, which the others reach too.
            own = master_address if rank == 0 else route_address(master_address)
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=own)]
            return dist.ProcessGroupGloo(prefixed, rank, world_size, options)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = delta
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    except (RuntimeError, ValueError) as exc:  # torch's DistStoreError and gloo's errors are RuntimeErrors
        raise WeightGroupError(f"could not join weights group {group_name!r} at {master_address}:{master_port} as "
                               f"rank {rank} of {world_size} ({backend}): {exc}") from exc


# ---- tensor metadata ----------------------------------------------------------------------------


def dtype_name(dtype: torch.dtype) -> str:
    """The name SGLang's `dtypes` use: torch's attribute name (`bfloat16`), without `torch.`."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: object, tensor: str) -> torch.dtype:
    """A `dtypes` entry as SGLang reads it (`getattr(torch, name)`); ValueError naming the tensor."""
    dtype = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"tensor {tensor}: dtype {name!r} is not a torch dtype name (e.g. 'bfloat16', 'float32')")
    return dtype


def parse_bucket(names: object, dtypes: object, shapes: object) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """The (name, dtype, shape) of each tensor a bucket announces, in broadcast order; ValueError
    naming the field or the tensor when they cannot be read."""
    for key, value in (("names", names), ("dtypes", dtypes), ("shapes", shapes)):
        if not isinstance(value, list):
            raise ValueError(f"{key} must be a list, got {type(value).__name__}")
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"names, dtypes and shapes must have the same length, got {len(names)}, {len(dtypes)} "
                         f"and {len(shapes)}")
    if not names:
        raise ValueError("names is empty: a bucket has at least one tensor")
    specs = []
    for name, dtype, shape in zip(names, dtypes, shapes):
        if not isinstance(name, str) or not name:
            raise ValueError(f"names must be non-empty strings, got {name!r}")
        if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                for d in shape)):
            raise ValueError(f"tensor {name}: shape {shape!r} is not a list of non-negative integers")
        specs.append((name, parse_dtype(dtype, name), tuple(shape)))
    if len({name for name, _, _ in specs}) != len(specs):
        raise ValueError(f"tensor {next(n for n in names if names.count(n) > 1)} is named twice in one bucket")
    return specs


def bucket_request(bucket: Sequence[tuple[str, torch.Tensor]]) -> dict:
    """The `names`, `dtypes` and `shapes` of SGLang's /update_weights_from_distributed for a bucket."""
    return {"names": [name for name, _ in bucket], "dtypes": [dtype_name(t.dtype) for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket]}


ALIGN = 64
"""Byte alignment of each tensor in a receive buffer (any dtype's element size divides it)."""


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def bucket_bytes(specs: Sequence[tuple[str, torch.dtype, tuple[int, ...]]]) -> int:
    """Bytes of a receive buffer that holds a bucket's tensors (each aligned)."""
    return sum(_aligned(math.prod(shape) * dtype.itemsize) for _, dtype, shape in specs)


def receive(group: dist.ProcessGroup, specs: Sequence[tuple[str, torch.dtype, tuple[int, ...]]],
            buffer: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The tensors rank 0 broadcasts for one bucket, in the announced order (all posted at once,
    then waited for, as SGLang does). With `buffer` (flat uint8, at least `bucket_bytes(specs)`)
    they are views of it: the caller must be done with them before the buffer takes the next bucket."""
    if buffer is None:
        tensors = {name: torch.empty(shape, dtype=dtype) for name, dtype, shape in specs}
    else:
        tensors, offset = {}, 0
        for name, dtype, shape in specs:
            n = math.prod(shape) * dtype.itemsize
            tensors[name] = buffer[offset:offset + n].view(dtype).view(shape)
            offset += _aligned(n)
    works = [group.broadcast(tensor, 0) for tensor in tensors.values()]
    for work in works:
        work.wait()
    return tensors


def send(group: dist.ProcessGroup, bucket: Sequence[tuple[str, torch.Tensor]], device: str = "cpu") -> None:
    """Broadcast a bucket's tensors from rank 0, in order, from `device` (the group's: gloo sends
    from the CPU, nccl from the GPU)."""
    tensors = [tensor.detach().to(device).contiguous() for _, tensor in bucket]  # alive until every wait
    works = [group.broadcast(tensor, 0) for tensor in tensors]
    for work in works:
        work.wait()
