"""Weights by CUDA IPC handles, for servers on the trainer's own GPU (colocated): SGLang's
`/update_weights_from_tensor`. Trainer rank 0 sends each bucket as handles to the tensors it
already holds, and every server copies them straight from the trainer's memory into its model:
no file, no second copy on the wire.

The body carries `serialized_named_tensors`, one base64 string per tensor-parallel rank of the
server (the embedded engine is one), each a multiprocessing pickle of a list of (name, tensor)
that holds handles, not data. On the CPU the same code passes shared-memory files by name (torch's
`file_system` sharing strategy), which is how the CPU tests run this channel end to end.

A pickle from a socket can run code: the server reads it with `deserialize`, which admits only
torch's tensor and storage rebuilders and dtypes, and refuses anything else naming it.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from areal_flow.weights.sender import Server, TransferReport, WeightTransferError, check_arrivals, post, send_all
from areal_flow.weights.trainer_sent import TrainerSent

ALLOWED = {
    "torch.multiprocessing.reductions": {"rebuild_tensor", "rebuild_cuda_tensor", "rebuild_typed_storage",
                                         "rebuild_storage_filename", "rebuild_storage_empty",
                                         "rebuild_typed_storage_child"},
    "torch.storage": {"UntypedStorage", "TypedStorage"},
    "torch.cuda": {name for name in dir(torch.cuda) if name.endswith("Storage")},  # legacy typed storages
    "torch": {"Tensor", "Size", "device", *(name for name in dir(torch) if isinstance(getattr(torch, name, None),
                                                                                    torch.dtype))},
}
"""What a serialized bucket may name: the rebuilders torch's reductions emit for CPU and CUDA
tensors, storage classes and dtypes."""


def serialize(named: Sequence[tuple[str, torch.Tensor]]) -> tuple[str, list[torch.Tensor]]:
    """A bucket as one base64 string of IPC handles (CUDA) or shared-memory file names (CPU), and
    the tensors it refers to, which the caller keeps alive until every server has loaded them.

    A CUDA tensor is handed over as it is: the servers copy from the trainer's own memory. A CPU
    tensor is copied into a shared-memory file of its own for this one send: torch's file-system
    sharing counts the processes that map a file, and a file that the trainer's long-lived
    parameters share with servers that map and unmap it every step was seen unlinked under the
    trainer (a send to two servers, on the second version)."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as mp

    if any(t.device.type == "cpu" for _, t in named):
        # An unrelated process (the server) can open a shared-memory file by its name, not a file
        # descriptor that only a forked child inherits.
        mp.set_sharing_strategy("file_system")
    sent = [(name, t.detach() if t.is_cuda else t.detach().clone()) for name, t in named]
    buffer = io.BytesIO()
    ForkingPickler(buffer, pickle.HIGHEST_PROTOCOL).dump(sent)
    return base64.b64encode(buffer.getvalue()).decode("ascii"), [t for _, t in sent]


class _Restricted(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name not in ALLOWED.get(module, ()):
            raise ValueError(f"a serialized tensor may not name {module}.{name}")
        return super().find_class(module, name)


def deserialize(text: object) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) list of one serialized bucket; ValueError saying what is wrong with it."""
    import torch.multiprocessing  # noqa: F401  (registers the reductions' rebuilders)

    if not isinstance(text, str):
        raise ValueError(f"a serialized bucket must be a base64 string, got {type(text).__name__}")
    try:
        named = _Restricted(io.BytesIO(base64.b64decode(text, validate=True))).load()
    except (binascii.Error, pickle.UnpicklingError, EOFError) as exc:
        raise ValueError(f"a serialized bucket does not decode: {exc}") from None
    except RuntimeError as exc:  # the handle or file no longer exists: the sender freed it
        raise ValueError(f"a serialized bucket's tensors cannot be opened: {exc}") from None
    if not (isinstance(named, list) and all(isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str)
                                            and isinstance(x[1], torch.Tensor) for x in named)):
        raise ValueError("a serialized bucket must be a list of (name, tensor) pairs")
    return named


class IpcSender:
    """Trainer rank 0's end: posts each bucket's handles to every server, all at once."""

    def __init__(self, servers: Sequence[Server], *, timeout: float = 600.0, api_key: str | None = None) -> None:
        if not servers:
            raise ValueError("CUDA IPC needs at least one generation server")
        self.servers, self.timeout = list(servers), timeout
        self.headers = {"Content-Type": "application/json"}
        if api_key is not None:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def send(self, buckets: Iterable[Sequence[tuple[str, torch.Tensor]]], version: int | str | None, *,
             abort_all_requests: bool = False, flush_cache: bool = True, lora_config: dict | None = None
             ) -> TransferReport:
        """Every bucket to every server; each call returns once the server has copied it (with
        `lora_config`: merged it as adapters, which each must report as sent). Every bucket is taken
        even after a failure (the export is a collective under FSDP)."""
        with ThreadPoolExecutor(len(self.servers)) as pool:
            def send_bucket(bucket: Sequence[tuple[str, torch.Tensor]], index: int) -> None:
                text, alive = serialize(bucket)  # `alive` until every server has copied the tensors
                body = {"serialized_named_tensors": [text], "load_format": None,
                        "flush_cache": flush_cache, "abort_all_requests": abort_all_requests}
                if version is not None:
                    body["weight_version"] = str(version)
                if lora_config is not None:
                    body["lora_config"] = lora_config
                calls = [pool.submit(post, s.url, "/update_weights_from_tensor", body, self.headers, self.timeout)
                         for s in self.servers]
                failed = [f"{s.name}: {c.exception()}" for s, c in zip(self.servers, calls) if c.exception()]
                del alive
                what = f"bucket {index} of weight version {version} ({len(bucket)} tensors, first {bucket[0][0]})"
                if failed:
                    raise WeightTransferError(f"{what}: " + "; ".join(failed))
                check_arrivals(what, {s.name: c.result() for s, c in zip(self.servers, calls)}, bucket, version,
                               lora_config)

            return send_all(buckets, version, send_bucket)


class IpcChannel(TrainerSent):
    """rollout.weight_update_mode=ipc: handles from trainer rank 0 to servers on its own GPU."""

    name = "ipc"

    def make_sender(self) -> IpcSender:
        return IpcSender(self.servers, timeout=self.timeout, api_key=self.api_key)

    def source(self, location: str) -> str:
        return "by CUDA IPC"
