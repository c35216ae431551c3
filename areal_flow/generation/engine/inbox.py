"""What the callers of the engine hand its decode thread, behind one lock: the queue of requests,
the commands (weight updates, aborts and pauses), and the flags the thread reads between two
steps. Callers put things in (generation/engine/generation_engine.py); the decode thread takes them out
(generation/engine/decode_loop.py)."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence

from areal_flow.generation.engine.commands import Abort, WeightUpdate
from areal_flow.generation.engine.kv_batch import Row
from areal_flow.generation.engine.requests import EngineShutdownError


class Inbox:
    """The engine's shared state; `cond` guards every field and wakes the decode thread."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.waiting: deque[Row] = deque()
        """Requests not yet running, in order (retracted ones back at the head)."""
        self.updates: deque[WeightUpdate] = deque()
        self.aborts: list[Abort] = []
        self.paused = False
        self.flush = False
        """flush_cache asked: the decode thread empties the prefix cache next."""
        self.inflight: set[str] = set()
        """The rids of the requests queued or running: a new request may not reuse one."""
        self.stopping = False

    def queue(self, rows: Sequence[Row], rids: Sequence[str]) -> None:
        """Queue `rows`, whose requests (with others answered at once) have the rids `rids`: none or
        all. Raises EngineShutdownError once stopping, ValueError if a rid is still in flight."""
        with self.cond:
            if self.stopping:
                raise EngineShutdownError("the generation engine is shut down")
            clash = next((rid for rid in rids if rid in self.inflight), None)
            if clash is not None:
                raise ValueError(f"Duplicate request ID detected: {clash} is still in flight")
            for row in rows:
                self.inflight.add(row.request.rid)
                self.waiting.append(row)
            self.cond.notify_all()

    def hand_over(self, queue: deque | list, command: WeightUpdate | Abort, wait: bool = True) -> None:
        """Queue a command for the decode thread, which carries it out between two steps; wait for it."""
        with self.cond:
            if self.stopping:
                raise EngineShutdownError("the generation engine is shut down")
            queue.append(command)
            self.cond.notify_all()
        if wait:
            command.done.result()

    def set_paused(self, paused: bool) -> None:
        with self.cond:
            self.paused = paused
            self.cond.notify_all()

    def ask_flush(self) -> None:
        with self.cond:
            self.flush = True
            self.cond.notify_all()

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()

    def forget(self, rows: Sequence[Row]) -> None:
        """Free the rids of rows that are answered or dropped (caller holds the lock)."""
        for row in rows:
            self.inflight.discard(row.request.rid)
