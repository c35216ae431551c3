"""Channels whose trainer ranks send each version when the controller asks, once the servers are
paused (broadcast.py, ipc.py): the step writes nothing, and the next step waits for the delivery."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from areal_flow.transport.messages import PublishWeights, WeightsPublished
from areal_flow.weights.channel import SendByTrainers, UpdateFlags, WeightChannel
from areal_flow.weights.sender import Server, WeightTransferError
from areal_flow.weights.update import WeightUpdateError

if TYPE_CHECKING:
    from areal_flow.generation.client.router import Server as PoolServer
    from areal_flow.generation.client.router import ServerPool
    from areal_flow.training.engine import Engine

log = logging.getLogger("areal_flow.weights")


class TrainerSent(WeightChannel):
    """Rank 0 sends, bucket by bucket, what every rank gathers; `make_sender` is the medium."""

    sent_by_trainers = True
    every_server = True

    def __init__(self, servers: list[Server], *, bucket_bytes: int = 512 << 20, timeout: float = 600.0,
                 api_key: str | None = None, adapters: bool = True) -> None:
        """`adapters`: a trainer of LoRA adapters sends them alone (the embedded servers merge them);
        false, it sends the merged weights (real SGLang)."""
        self.servers, self.bucket_bytes, self.timeout, self.api_key = servers, bucket_bytes, timeout, api_key
        self.adapters = adapters
        self._sender: Any = None  # made at the first send, on rank 0

    def make_sender(self) -> Any:
        """An object with `servers` and `send(buckets, version, abort_all_requests=, flush_cache=,
        lora_config=)` returning a TransferReport or raising WeightTransferError; with `lora_config`
        the buckets are adapters, and each server must report the digest of those it merged."""
        raise NotImplementedError

    def send(self, engine: Engine, msg: PublishWeights, rank: int) -> WeightsPublished:
        buckets, lora_config = (engine.export_update(self.bucket_bytes) if self.adapters
                                else (engine.export_weights(self.bucket_bytes), None))
        if rank != 0:
            for _ in buckets:  # a collective under FSDP and megatron: every rank gathers each bucket
                pass
            return WeightsPublished(rank, msg.version)
        if self._sender is None:
            self._sender = self.make_sender()
        try:
            report = self._sender.send(buckets, msg.version, abort_all_requests=msg.abort_all_requests,
                                       flush_cache=not msg.keep_cache, lora_config=lora_config)
        except WeightTransferError as exc:
            log.error("weight version %d was not sent: %s", msg.version, exc)
            return WeightsPublished(rank, msg.version, error=str(exc))
        log.info("weight version %d sent to %d server(s) %s: %.1f MB in %d bucket(s), %.2f s (%.2f GB/s)",
                 msg.version, len(self.servers), self.source(""), report.bytes / 1e6, report.buckets, report.seconds,
                 report.gb_per_second)
        return WeightsPublished(rank, msg.version, buckets=report.buckets, bytes=report.bytes, seconds=report.seconds)

    async def deliver(self, pool: ServerPool, servers: list[PoolServer], location: str, version: int,
                      flags: UpdateFlags, trainers: SendByTrainers) -> list[str]:
        try:
            await trainers(version, flags)
        except WeightUpdateError as exc:
            return [str(exc)]
        return []

    def close(self) -> None:
        if self._sender is not None and hasattr(self._sender, "close"):
            self._sender.close()
