"""What other threads hand the engine's decode thread, which carries each out between two decode
steps and then sets its `done` future (generation/engine/generation_engine.py)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

PAUSE_MODES = ("abort", "retract", "in_place")
"""SGLang's pause modes, all implemented by the engine."""


@dataclass
class WeightUpdate:
    source: str
    """What they came from, for the log."""
    version: int
    label: str | None
    """None: keep the current label."""
    state: dict[str, torch.Tensor]
    abort_all: bool
    """Abort the running requests instead of waiting for them."""
    adapter_digest: str | None = None
    """The digest of the adapters merged by `merge` (LoRA updates); None: full weights."""
    merge: Callable[[torch.nn.Module], None] | None = None
    """LoRA updates: merges the adapters into the model's weights in place, after `state` is copied in."""
    done: Future = field(default_factory=Future)


@dataclass
class Abort:
    rid: str | None
    """None: every request."""
    queued_too: bool
    """Also answer the matching requests that wait in the queue."""
    retract: bool = False
    """Requeue the running requests with their tokens instead of answering them."""
    in_place: bool = False
    """Touch no request: only return once the thread is between two steps."""
    done: Future = field(default_factory=Future)
