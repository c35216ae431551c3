"""A server's end of the weights groups it joined (weights/group.py): the trainer's rank 0
broadcasts each bucket, the server receives it into a buffer kept from bucket to bucket."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from areal_flow.weights import group as weight_group

WEIGHT_GROUP_TIMEOUT = 600.0
"""Seconds a server waits for the other ranks of a weights group: to join it, and for each
broadcast (the trainer gathers a bucket meanwhile)."""


@dataclass(eq=False)
class WeightGroup:
    """A weights group this server joined: trainer rank 0 broadcasts, this server is `rank`."""

    name: str
    process_group: Any
    rank: int
    world_size: int
    lock: threading.Lock
    """Held while a bucket is received and loaded: two buckets on one group must not interleave,
    and the next one is received into the same buffer."""
    device: Any = "cpu"
    """Where the buffer lives: the backend's memory (gloo: the CPU, nccl: the engine's GPU)."""
    buffer: Any = None
    """The receive buffer (flat uint8), kept from bucket to bucket and grown to the largest. Fresh
    memory costs its page faults on every bucket: 0.5 s per GB on the 2-core test machine, about
    as much as the broadcast itself; a GPU caching allocator keeps its blocks the same way."""

    def receive(self, specs: list) -> dict:
        size = weight_group.bucket_bytes(specs)
        if self.buffer is None or self.buffer.numel() < size:
            self.buffer = None  # the old one is freed before the larger one is made
            self.buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
        return weight_group.receive(self.process_group, specs, self.buffer)
