"""Trainer rank 0's end of the weights group (`rollout.weight_update_mode: distributed`; broadcast.py).

Once, the sender makes the group: it opens the rendezvous store, asks every generation server to
join (`POST /init_weights_update_group`, all at once) and joins itself as rank 0. Then for each new
version it takes the engine's weights bucket by bucket (`Engine.export_weights`, the same Hugging
Face names the disk path writes) and, per bucket, announces the tensors to every server (`POST
/update_weights_from_distributed`: names, dtypes, shapes, weight_version) while it broadcasts them.
Each server answers once it has received and loaded the bucket. These are SGLang's routes and
fields, so the servers may be real SGLang or the embedded engine alike.

The controller drives an update: it pauses the servers, tells the trainer ranks to send
(`PublishWeights`), and continues the servers once rank 0 reports (`WeightsPublished`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from areal_flow.weights import adapter as adapter_files
from areal_flow.weights import group as weight_group

log = logging.getLogger("areal_flow.weights")

REFUSAL_GRACE = 5.0
"""Seconds the sender waits for its broadcast after a server refused a bucket: a server refuses a
bucket that does not fit its model only after receiving it, so the broadcast is done by then; if it
is not, the server refused without receiving, and the group is unusable."""


class WeightTransferError(RuntimeError):
    """A transfer failed; the message names the server, the bucket and what went wrong."""


@dataclass(frozen=True)
class Server:
    """A generation server of the group."""

    name: str
    url: str
    ranks: int = 1
    """Its ranks in the group: every TP rank of a real SGLang server joins (rank_offset + tp_rank);
    the embedded engine is one."""


@dataclass(frozen=True)
class TransferReport:
    version: int | str | None
    buckets: int
    tensors: int
    bytes: int
    seconds: float

    @property
    def gb_per_second(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0


class WeightSender:
    """Sends weights from this process (the group's rank 0) to `servers` by broadcast."""

    def __init__(self, servers: Sequence[Server], *, backend: str = "gloo", master_address: str = "127.0.0.1",
                 group_name: str = weight_group.DEFAULT_GROUP, timeout: float = 600.0,
                 api_key: str | None = None) -> None:
        """`master_address`: where the servers reach this process's rendezvous store; `timeout`:
        seconds to wait for a server's answer, and for the group (joining, each broadcast);
        `api_key`: the servers' (a secured run's), sent as a bearer token."""
        if not servers:
            raise ValueError("a weights group needs at least one generation server")
        self.servers = list(servers)
        self.backend = backend
        self.master_address = master_address
        self.group_name = group_name
        self.timeout = timeout
        self.headers = {"Content-Type": "application/json"}
        if api_key is not None:
            self.headers["Authorization"] = f"Bearer {api_key}"
        offsets, next_rank = [], 1  # rank 0 is this process
        for server in self.servers:
            offsets.append(next_rank)
            next_rank += server.ranks
        self.rank_offsets = offsets
        self.world_size = next_rank
        self.group: Any = None  # the process group, once made
        self._store: Any = None  # the rendezvous store: the group's backend keeps using it
        self.broken = ""  # why the group can no longer be used, once it cannot

    @property
    def device(self) -> str:
        return "cuda" if self.backend == "nccl" else "cpu"

    def connect(self) -> None:
        """Make the group: every server joins (its HTTP call) while this process joins as rank 0."""
        if self.group is not None:
            return
        self._store = weight_group.master_store(self.master_address, self.world_size, self.timeout)
        port = self._store.port
        requests = {
            server.name: partial(self._post, server, "/init_weights_update_group", {
                "master_address": self.master_address, "master_port": port, "rank_offset": offset,
                "world_size": self.world_size, "group_name": self.group_name, "backend": self.backend})
            for server, offset in zip(self.servers, self.rank_offsets)
        }
        join = partial(weight_group.join, self._store, master_address=self.master_address, master_port=port, rank=0,
                       world_size=self.world_size, group_name=self.group_name, backend=self.backend,
                       timeout=self.timeout)
        self.group, _ = self._together(f"joining weights group {self.group_name!r}", join, requests)
        log.info("weights group %r: %d server(s), %d ranks, %s, store at %s:%d", self.group_name, len(self.servers),
                 self.world_size, self.backend, self.master_address, port)

    def send(self, buckets: Iterable[Sequence[tuple[str, torch.Tensor]]], version: int | str | None, *,
             abort_all_requests: bool = False, flush_cache: bool = True, lora_config: dict | None = None
             ) -> TransferReport:
        """Send every bucket to every server as weight version `version` (the servers' label: SGLang's
        weight_version; None keeps it). Every bucket is taken from `buckets` even after a failure:
        the engine's export is a collective under FSDP and megatron, which the other trainer ranks
        run to the end too. Raises WeightTransferError naming the server and the bucket. With
        `lora_config` the bucket is LoRA adapters (weights/adapter.py), which every server must
        report having merged as sent."""
        error: WeightTransferError | None = None
        try:
            if self.broken:
                raise WeightTransferError(f"weights group {self.group_name!r} is unusable: {self.broken}")
            self.connect()
        except (WeightTransferError, weight_group.WeightGroupError) as exc:
            error = exc if isinstance(exc, WeightTransferError) else WeightTransferError(str(exc))
        return send_all(buckets, version, lambda bucket, index: self.send_bucket(
            bucket, version, abort_all_requests=abort_all_requests, flush_cache=flush_cache, index=index,
            lora_config=lora_config), error)

    def send_bucket(self, bucket: Sequence[tuple[str, torch.Tensor]], version: int | str | None, *,
                    abort_all_requests: bool = False, flush_cache: bool = True, index: int = 0,
                    lora_config: dict | None = None) -> None:
        """Announce one bucket to every server and broadcast its tensors; returns once every server
        has loaded it (with `lora_config`: merged it as adapters, as sent)."""
        if self.group is None:
            raise WeightTransferError("the weights group is not made yet (connect)")
        body: dict[str, Any] = weight_group.bucket_request(bucket) | {
            "group_name": self.group_name, "abort_all_requests": abort_all_requests, "flush_cache": flush_cache}
        if version is not None:
            body["weight_version"] = str(version)  # SGLang declares it a string
        if lora_config is not None:
            body["lora_config"] = lora_config
        requests = {server.name: partial(self._post, server, "/update_weights_from_distributed", body)
                    for server in self.servers}
        what = f"bucket {index} of weight version {version} ({len(bucket)} tensors, first {bucket[0][0]})"
        _, answers = self._together(what, partial(weight_group.send, self.group, bucket, self.device), requests)
        check_arrivals(what, answers, bucket, version, lora_config)

    def close(self) -> None:
        """Ask every server to leave the group (best effort) and drop this end."""
        if self.group is not None and not self.broken:
            for server in self.servers:
                try:
                    self._post(server, "/destroy_weights_update_group", {"group_name": self.group_name})
                except (WeightTransferError, OSError) as exc:
                    log.warning("%s did not leave weights group %r: %s", server.name, self.group_name, exc)
        self.group = self._store = None

    # ---- plumbing -----------------------------------------------------------------------------

    def _together(self, what: str, collective: Callable[[], Any], requests: dict[str, Callable[[], dict]]
                  ) -> tuple[Any, dict[str, dict]]:
        """Run this rank's part of a group operation while every server's HTTP call runs (each on a
        thread of its own); its result and the servers' answers once all are done. A call that fails
        before the collective is done leaves it waiting for that server forever: the group is then
        marked unusable."""
        mine = _on_thread(collective)
        calls = {name: _on_thread(call) for name, call in requests.items()}
        pending: set[Future] = {mine, *calls.values()}
        while pending and not mine.done():
            _, pending = wait(pending, return_when=FIRST_COMPLETED)
            failed = [name for name, call in calls.items() if call.done() and call.exception() is not None]
            if failed and not mine.done():
                wait([mine], timeout=REFUSAL_GRACE)
                if not mine.done():
                    problems = "; ".join(_describe(name, calls[name].exception()) for name in failed)
                    self.broken = f"{what} failed: {problems}"
                    raise WeightTransferError(f"{what}: {problems}; the group waits for them and cannot be used "
                                              "again")
        if mine.exception() is not None:
            self.broken = f"{what} failed: {mine.exception()}"
            raise WeightTransferError(f"{what}: this rank failed: {mine.exception()}")
        wait(calls.values())  # each server answers once it has joined, or loaded the bucket
        problems = [_describe(name, call.exception()) for name, call in calls.items() if call.exception() is not None]
        if problems:
            raise WeightTransferError(f"{what}: " + "; ".join(problems))
        return mine.result(), {name: call.result() for name, call in calls.items()}

    def _post(self, server: Server, path: str, body: dict) -> dict:
        return post(server.url, path, body, self.headers, self.timeout)


def check_arrivals(what: str, answers: dict[str, dict], bucket: Sequence[tuple[str, torch.Tensor]],
                   version: int | str | None, lora_config: dict | None) -> None:
    """With `lora_config` (`bucket` is adapters), every server's answer must report the digest of
    the adapters as sent; else WeightTransferError naming each server that does not."""
    if lora_config is None:
        return
    expected = adapter_files.digest(dict(bucket))
    problems = [f"{name}: {problem}" for name, answer in answers.items()
                if (problem := adapter_files.arrival_problem(answer, expected, version))]
    if problems:
        raise WeightTransferError(f"{what}: " + "; ".join(problems))


def send_all(buckets: Iterable[Sequence[tuple[str, torch.Tensor]]], version: int | str | None,
             send_bucket: Callable[[Sequence[tuple[str, torch.Tensor]], int], None],
             error: WeightTransferError | None = None) -> TransferReport:
    """send_bucket(bucket, index) for each bucket until one raises WeightTransferError (or `error`
    is given: a failure before the first); every bucket is taken from `buckets` either way, since
    the engine's export is a collective the other trainer ranks run to the end. Raises the error."""
    t0, n_buckets, n_tensors, n_bytes = time.perf_counter(), 0, 0, 0
    for bucket in buckets:
        if error is not None:
            continue
        try:
            send_bucket(bucket, n_buckets)
        except WeightTransferError as exc:
            error = exc
        n_buckets += 1
        n_tensors += len(bucket)
        n_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
    if error is not None:
        raise error
    return TransferReport(version, n_buckets, n_tensors, n_bytes, time.perf_counter() - t0)


def post(url: str, path: str, body: dict, headers: dict[str, str], timeout: float) -> dict:
    """POST a JSON body to a server; the decoded answer, or _Refused carrying the server's message."""
    request = urllib.request.Request(url.rstrip("/") + path, data=json.dumps(body).encode(), headers=headers,
                                     method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return json.loads(answer.read() or b"{}")
    except urllib.error.HTTPError as exc:
        raise _Refused(path, exc.code, exc.read()) from None


class _Refused(Exception):
    def __init__(self, path: str, status: int, body: bytes) -> None:
        try:
            decoded = json.loads(body)
            message = decoded.get("message") or decoded.get("error", {}).get("message") or decoded
        except (ValueError, AttributeError):
            message = body.decode("utf-8", errors="replace")
        super().__init__(f"{path} answered {status}: {message}")


def _describe(name: str, exc: BaseException | None) -> str:
    if isinstance(exc, _Refused):
        return f"{name} refused it: {exc}"
    return f"{name} could not be reached: {exc!r}"


def _on_thread(fn: Callable[[], Any]) -> Future:
    """`fn` on a daemon thread: one blocked in a broadcast that will never complete must not hold
    up the process's exit."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:
            future.set_exception(exc)

    threading.Thread(target=run, name="weights-sender", daemon=True).start()
    return future
