"""A digest of named tensors that is equal iff they are bit for bit: the flight record's digest of a
trainer's weights after each step (training/flight.py) and a LoRA update's digest of its adapters,
which each server reports back (weights/adapter.py)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where tensors are handled: the rollout workers' client reads adapter.py
    import torch


def weights_digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """blake2b of the tensors' names, dtypes, shapes and bytes, in the order given (a DTensor: this
    rank's shard): equal digests are equal tensors, bit for bit, whatever their memory layout."""
    import torch

    h = hashlib.blake2b(digest_size=16)
    for name, tensor in named:
        t = tensor.detach()
        t = t.to_local() if hasattr(t, "to_local") else t
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
