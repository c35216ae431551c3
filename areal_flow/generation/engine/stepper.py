"""The contract between the engine's decode loop and a way of holding and stepping a batch: the
engine decides what to run (generation/engine/scheduler.py) and answers requests; a Stepper runs it.

Two backends: `DenseStepper` (dense_stepper.py), the transformers forward over a left-padded cache
that grows in place, for any architecture; `PagedStepper` (paged_stepper.py), the engine's own
forward over a paged cache with chunked prefill, a prefix cache, the overlap schedule and CUDA
graphs, for the architectures generation/engine/decode.py takes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from areal_flow.generation.engine.kv_batch import Row
from areal_flow.generation.engine.scheduler import Capacity


class Stepper(ABC):
    """Runs decode steps over a batch of its own kind (`Any` to the engine, which only asks it for
    its rows: `live()`, `live_rows()`, `rows`). Called on the decode thread only."""

    @abstractmethod
    def capacity(self, batch: Any | None, live: list[Row], room: int, queued: int) -> Capacity | None:
        """What the batch's cache can take of the queue (`room` more rows at most, `queued` waiting);
        None: let none join now."""

    @abstractmethod
    def step(self, batch: Any | None, admitted: list[Row], started: float) -> Any | None:
        """Prefill `admitted` into `batch` (None: no batch yet), sample a token for each of its
        rows and run the next forward; returns the batch, None once no row is left. Rows that end
        go to the shared Sampler's `finished`. `started`: time.perf_counter() when the step began,
        for the compute counts."""

    def discard(self, batch: Any | None) -> None:
        """Drop a batch and its KV cache (and whatever a failed step left taken)."""

    def flush(self) -> None:
        """Empty the prefix cache (the old weights' keys and values), if the backend keeps one."""

    def free_memory(self) -> None:
        """Hand the cache's memory back (no batch holds any of it now)."""

    def blocks(self) -> tuple[int, int, int]:
        """The paged cache's blocks used, total (0: it grows) and cached; zeros without one."""
        return 0, 0, 0
