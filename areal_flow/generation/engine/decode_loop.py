"""The engine's decode thread: wait for work, carry out the commands between two steps (aborts,
pauses, a flush of the prefix cache), then either load a weight update or run one step of the
batch on the stepper, and answer the rows that ended. What joins the batch is the scheduler's
(generation/engine/scheduler.py); how the batch is held and stepped, the stepper's (generation/engine/stepper.py);
the semantics of aborts, pauses and updates are in generation/engine/generation_engine.py's docstring."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from areal_flow.generation.compute_counts import ComputeCounts
from areal_flow.generation.engine import scheduler
from areal_flow.generation.engine.checkpoint import copy_in
from areal_flow.generation.engine.commands import Abort, WeightUpdate
from areal_flow.generation.engine.inbox import Inbox
from areal_flow.generation.engine.kv_batch import Row
from areal_flow.generation.engine.requests import EngineShutdownError
from areal_flow.generation.engine.sampler import Sampler
from areal_flow.generation.engine.step_timing import StepTimer
from areal_flow.generation.engine.stepper import Stepper

logger = logging.getLogger(__name__)


@dataclass
class _Work:
    """What the decode thread took under the lock for one turn of its loop."""

    batch: Any | None  # the running batch (None once a retraction dropped it)
    aborts: list[Abort]
    aborted: list[Row]  # the rows the aborts hit, to answer
    flush: bool  # empty the prefix cache first
    update: WeightUpdate | None  # load these weights (no step this turn)
    admitted: list[Row]  # the rows that join the batch in this step


class DecodeLoop:
    """Runs on its own thread (`start`) until the inbox is stopping; then fails what is left."""

    def __init__(self, inbox: Inbox, stepper: Stepper, sampler: Sampler, counts: ComputeCounts,
                 model: torch.nn.Module, max_batch_size: int, timer: StepTimer | None) -> None:
        self.inbox, self.stepper, self.sampler, self.counts = inbox, stepper, sampler, counts
        self.model, self.max_batch_size, self.timer = model, max_batch_size, timer
        self.running: list[Row] = []  # the live rows after the last decode step
        self.busy_seconds = 0.0
        self.load_seconds = 0.0  # copying weight updates in (decoding stops meanwhile)
        self.idle_from: float | None = None  # when the thread began to wait for work, while it waits
        self.finished_reqs = 0
        self.finished_prompt_tokens = 0
        self.thread = threading.Thread(target=self.run, name="generation-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def run(self) -> None:
        """Take what there is to do, carry out the commands, then load an update or run a step."""
        batch = None
        with torch.inference_mode():
            while (work := self._next_work(batch)) is not None:
                batch = self._carry_out(work)
                started = time.perf_counter()
                if work.update is not None:
                    self._apply_update(work.update)
                elif (batch is not None or work.admitted) and not self.inbox.paused:
                    batch = self._step(batch, work.admitted, started)
                # else: woken for an abort, or paused (a batch held in place waits)
        self._shut_down(batch)

    def _next_work(self, batch: Any | None) -> _Work | None:
        """Wait until there is something to do and take it off the inbox; None: stopping."""
        inbox = self.inbox
        with inbox.cond:
            self._wait_for_work(batch)
            if inbox.stopping:
                return None
            aborts, inbox.aborts = inbox.aborts, []
            flush, inbox.flush = inbox.flush, False
            if inbox.updates and inbox.updates[0].abort_all:
                aborts.append(Abort(None, queued_too=False))
            if any(abort.retract for abort in aborts) and batch is not None:
                rows = batch.live_rows()
                self.stepper.discard(batch)  # the old weights' cache goes with it
                scheduler.requeue(inbox.waiting, rows)
                batch = None
            aborted: list[Row] = []
            if aborts:
                running = batch.live_rows() if batch is not None else []
                aborted, cancelled = scheduler.take_aborted(aborts, running, inbox.waiting)
                inbox.forget(cancelled)
            update, admitted = None, []
            if inbox.updates:
                # Admit nothing while an update waits, so the running batch drains. (An update with
                # abort_all has just aborted every running row; paused, the update is applied at
                # once, as SGLang does, also under a held batch.)
                if batch is None or not batch.live() or inbox.paused:
                    update = inbox.updates.popleft()
            elif not inbox.paused:
                admitted = self._admit(batch)
        return _Work(batch, aborts, aborted, flush, update, admitted)

    def _wait_for_work(self, batch: Any | None) -> None:
        """Wait (caller holds the lock) for a command, or requests to step: paused, nothing steps,
        and a batch held in place waits for continue_generation."""
        inbox = self.inbox
        self.idle_from = time.perf_counter()  # stats count a wait in progress too
        while not (inbox.stopping or (inbox.waiting and not inbox.paused) or inbox.updates
                   or inbox.aborts or (batch and not inbox.paused)):
            if self.timer is not None:
                self.timer.idle()  # the next step does not follow the last at once
            inbox.cond.wait()
        self.counts.waited += time.perf_counter() - self.idle_from
        self.idle_from = None

    def _admit(self, batch: Any | None) -> list[Row]:
        """Take the requests that join the running batch off the queue (caller holds the lock)."""
        waiting = self.inbox.waiting
        if not waiting:
            return []  # every decode step asks: spare it the pass over the running rows
        live = batch.live_rows() if batch is not None else []
        room = self.max_batch_size - len(live)
        capacity = self.stepper.capacity(batch, live, room, len(waiting))
        if capacity is None:
            return []
        admitted, cancelled = scheduler.admit(waiting, room, capacity)
        self.inbox.forget(cancelled)
        return admitted

    def _carry_out(self, work: _Work) -> Any | None:
        """Empty the prefix cache if asked, answer the aborted rows and the aborts; returns the
        batch, dropped if no row of it is left."""
        batch = work.batch
        if work.flush:
            self.stepper.flush()  # before anything new takes from it
        for row in work.aborted:
            self._finish(row)
        for abort in work.aborts:
            abort.done.set_result(None)
        if work.aborts:  # some rows may have been aborted or retracted
            if batch is not None and not batch.live():
                self.stepper.discard(batch)  # every row aborted: the old weights' cache goes with it
                batch = None
            self._count_running(batch)
        return batch

    def _step(self, batch: Any | None, admitted: list[Row], started: float) -> Any | None:
        """One decode step; a step that fails fails the requests in it, and the engine goes on."""
        try:
            batch = self.stepper.step(batch, admitted, started)
        except Exception as exc:
            logger.exception("decode step failed; failing the requests in it")
            self._answer_finished()  # rows finished before the failure keep their answers
            self._fail([*(batch.rows if batch else ()), *admitted], exc)
            self.stepper.discard(batch)
            batch = None
        # Time spent computing, for the generator's busy fraction in the run metrics.
        self.busy_seconds += time.perf_counter() - started
        self._answer_finished()
        self._count_running(batch)
        return batch

    def _apply_update(self, update: WeightUpdate) -> None:
        started, error = time.perf_counter(), None
        try:
            copy_in(self.model, update.state)
            if update.apply is not None:
                update.apply(self.model)
            self.sampler.version = update.version
            if update.label is not None:
                self.sampler.label = update.label
            self.sampler.adapter_digest = update.adapter_digest
            self.stepper.flush()  # cached keys and values are the old weights'
        except Exception as exc:
            logger.exception("weight update from %s failed", update.source)
            error = exc
        # Counted before the caller hears it is done: it may read the stats next.
        self.load_seconds += time.perf_counter() - started
        if error is not None:
            update.done.set_exception(error)
        else:
            logger.info("weights from %s loaded, version %d", update.source, update.version)
            update.done.set_result(None)

    def _shut_down(self, batch: Any | None) -> None:
        """Fail every request and update still in the engine (the thread is ending)."""
        self._count_running(None)
        inbox = self.inbox
        with inbox.cond:
            waiting, updates, aborts = list(inbox.waiting), list(inbox.updates), inbox.aborts
            inbox.waiting.clear()
            inbox.updates.clear()
            inbox.aborts = []
        for abort in aborts:  # the requests it was for fail below, which answers them too
            abort.done.set_result(None)
        self._fail([*(batch.rows if batch else ()), *waiting], EngineShutdownError("the generation engine shut down"))
        self.stepper.discard(batch)
        for update in updates:
            update.done.set_exception(EngineShutdownError("the generation engine shut down before the update"))

    def _count_running(self, batch: Any | None) -> None:
        # The rows only: stats sum their tokens when asked, not every decode step.
        self.running = batch.live_rows() if batch is not None else []

    def _finish(self, row: Row) -> None:
        assert row.finish is not None
        # Free the rid first: a client may reuse it as soon as it reads the answer.
        with self.inbox.cond:
            self.inbox.forget([row])
        self.finished_reqs += 1
        self.finished_prompt_tokens += len(row.request.input_ids)
        self.counts.answered += 1
        row.future.set_result(self.sampler.result(row, row.finish))

    def _answer_finished(self) -> None:
        """Answer the rows a step finished, once its counts and busy time are in the stats: whoever
        reads an answer may read the stats next."""
        for row in self.sampler.take_finished():
            self._finish(row)

    def _fail(self, rows: Sequence[Row], exc: BaseException) -> None:
        # Rows already answered are skipped: their rid may already belong to a new request.
        # (A row can be listed twice: admitted, and already combined into the batch.)
        unanswered = list({id(row): row for row in rows if not row.future.done()}.values())
        with self.inbox.cond:
            self.inbox.forget(unanswered)
        for row in unanswered:
            row.future.set_exception(exc)
