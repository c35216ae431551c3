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
    """The digest of the adapters `apply` applies (LoRA updates); None: full weights."""
    apply: Callable[[torch.nn.Module], None] | None = None
    """Called with the model after `state` is copied in: a LoRA update's adapters merged into the
    weights or installed as low-rank paths; a full update's dropping of the paths
    (generation/engine/adapters.py)."""
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
