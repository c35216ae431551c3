"""Which queued requests join the running batch, and which requests an abort hits: pure code over
the queue and the rows (no lock, no thread, no model), which the engine calls under its lock.

Admission is in order: the head of the queue joins while the batch has room and the KV cache can
take it; the first request that does not fit stops the queue (the ones behind it wait their turn,
so a long request is never starved by short ones). What "fits" means is the backend's
(`Capacity`): the left-padded cache reserves every request's longest answer, the paged cache
counts blocks (generation/engine/paged_batch.py).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from areal_flow.generation.engine.commands import Abort
from areal_flow.generation.engine.kv_batch import Row
from areal_flow.generation.engine.paged_batch import can_follow


class Capacity(Protocol):
    """What the running batch's KV cache has left for requests that join it."""

    def fits(self, row: Row) -> bool:
        """Whether `row` can join now."""

    def take(self, row: Row) -> None:
        """Count `row` as joined."""


@dataclass
class TokenCapacity:
    """The left-padded cache (kv_batch.Batch): a request reserves the longest it may grow (prompt +
    max_new_tokens), so nothing is ever evicted mid-answer."""

    free: float
    """Tokens not reserved by the running rows (math.inf: no budget)."""

    @classmethod
    def of(cls, budget: int | None, live: Iterable[Row]) -> TokenCapacity:
        return cls(math.inf if budget is None else budget - sum(row.kv_tokens for row in live))

    def fits(self, row: Row) -> bool:
        return row.kv_tokens <= self.free

    def take(self, row: Row) -> None:
        self.free -= row.kv_tokens


@dataclass
class BlockCapacity:
    """The paged cache: the blocks a request needs now, with one block kept free for each running
    row's next token (a row that runs out later is retracted: PagedBatch.make_room). A request
    whose sequence is being prefilled and that can follow that prefill (`can_follow`) forks it:
    it needs only a copy of the last block, and one for its next token."""

    free: int
    block_size: int
    prefilling: set[tuple[int, ...]] = field(default_factory=set)
    """The sequences the batch is prefilling (those admitted here included)."""
    progress: dict[tuple[int, ...], int] = field(default_factory=dict)
    """How far each of those prefills has got (PagedBatch.prefill_progress; 0 for one admitted here)."""

    def _need(self, row: Row) -> tuple[int, bool]:
        """Blocks `row` takes, and whether it forks a prefill."""
        sequence = row.sequence
        if sequence in self.prefilling and can_follow(self.progress.get(sequence, 0), row):
            return 2, True  # its own copy of the last block, and the one its next token starts
        return -(-(len(sequence) + 1) // self.block_size) + 1, False

    def fits(self, row: Row) -> bool:
        return self._need(row)[0] <= self.free

    def take(self, row: Row) -> None:
        need, forks = self._need(row)
        self.free -= need
        self.prefilling.add(row.sequence)
        if not forks:  # it leads a prefill from the start, which any row can follow
            self.progress[row.sequence] = 0


def claim(row: Row) -> bool:
    """Mark a queued row's future as running; False if it was cancelled (its rid is then free). A
    retracted row's future is running already."""
    return row.future.running() or row.future.set_running_or_notify_cancel()


def admit(waiting: deque[Row], room: int, capacity: Capacity) -> tuple[list[Row], list[Row]]:
    """Take the rows that join the running batch off the head of `waiting`, in order: at most
    `room`, while `capacity` fits them. Returns them and the rows found cancelled on the way (taken
    off too, never to run)."""
    admitted: list[Row] = []
    cancelled: list[Row] = []
    while waiting and len(admitted) < room:
        row = waiting[0]
        if not capacity.fits(row):
            break  # it waits for running requests to finish; the ones behind it wait their turn
        waiting.popleft()
        if claim(row):
            admitted.append(row)
            capacity.take(row)
        else:
            cancelled.append(row)
    return admitted, cancelled


def take_aborted(aborts: Sequence[Abort], running: Sequence[Row], waiting: deque[Row]) -> tuple[list[Row], list[Row]]:
    """Mark the running rows that `aborts` match as finished by abort, and take the matching queued
    ones off `waiting` (marked the same) where an abort asks for them too. Returns the rows to
    answer, and the queued rows found cancelled (their rids to free)."""
    hit: list[Row] = []
    cancelled: list[Row] = []
    for abort in aborts:
        if abort.in_place:
            continue
        for row in running:
            if row.finish is None and abort.rid in (None, row.request.rid):
                row.finish = ("abort", None)
                hit.append(row)
        if abort.queued_too:
            for row in [row for row in waiting if abort.rid in (None, row.request.rid)]:
                waiting.remove(row)
                if claim(row):
                    row.finish = ("abort", None)
                    hit.append(row)
                else:
                    cancelled.append(row)
    return hit, cancelled


def requeue(waiting: deque[Row], rows: Sequence[Row]) -> None:
    """Put rows back at the head of `waiting`, in order, to be prefilled anew with their tokens so
    far (a retraction: each counts it)."""
    for row in rows:
        row.retractions += 1
    waiting.extendleft(reversed(rows))
