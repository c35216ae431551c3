"""A trainer resize on the controller's side (`scale RUN_DIR trainers=N`; the hand-offs with the
launcher are runtime/resize.py): between two steps, hold the scored groups that arrive, save the
run's checkpoint (each old rank's models and groups), let the launcher start the new ranks from
it, then route to them. Generation goes on meanwhile; no version is published, so the staleness
rule holds admissions as it would.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from areal_flow.controller.ledger import Ledger
from areal_flow.controller.peers import Peers
from areal_flow.controller.watchdog import Progress, Wait
from areal_flow.metrics.writer import MetricsWriter
from areal_flow.runtime import resize
from areal_flow.transport.messages import GroupMeta, Trainers

log = logging.getLogger("areal_flow.controller")

Held = list[tuple[bytes, GroupMeta]]
"""Scored groups that arrived during a resize, with the reward worker that sent each."""


class TrainerResize:
    def __init__(self, run_dir: str, timeout: float, peers: Peers, progress: Progress, ledger: Ledger,
                 metrics: MetricsWriter):
        """`timeout`: seconds the new ranks have to say Hello (launcher.start_timeout + step_timeout)."""
        self.run_dir, self.timeout, self.peers, self.progress = run_dir, timeout, peers, progress
        self.ledger, self.metrics = ledger, metrics
        self.asked: dict | None = None  # the resize the launcher asks for: {id, n}
        self.held: Held | None = None  # scored groups that arrive while it runs

    async def watch(self, wake: Callable[[], None]) -> None:
        """Look for a resize the launcher asks for, and `wake` the step loop when one comes."""
        while True:
            if self.asked is None and (ask := resize.asked(self.run_dir)) is not None \
                    and resize.answered(self.run_dir, resize.DONE, ask["id"]) is None:
                self.asked = ask
                wake()
            await asyncio.sleep(0.5)

    def hold(self, ident: bytes, meta: GroupMeta) -> bool:
        """Hold a scored group while the ranks are being resized; whether it was held."""
        if self.held is None:
            return False
        self.held.append((ident, meta))
        return True

    async def run(self, step: int, checkpoint: Callable[[int], Awaitable[str]],
                  regroup: Callable[[int], None]) -> Held:
        """Resize after `step` steps: `checkpoint(step)` saves the run (or names the checkpoint of
        `step` already saved); `regroup(n)` places the scored groups on `n` ranks once they are up.
        Returns the groups held meanwhile, to route to the new ranks."""
        ask, t0 = self.asked, time.monotonic()
        n, before = ask["n"], len(self.peers.ranks)
        self.held = []
        log.warning("controller: resizing the trainer ranks from %d to %d after step %d", before, n, step)
        path = await checkpoint(step)
        self.peers.forget_ranks()
        resize.answer(self.run_dir, resize.SAVED, ask["id"], checkpoint=path, step=step, n_before=before)
        self.progress.waits(Wait.NEW_RANKS, n=n, path=path)
        try:
            await self.peers.until_ranks(n, t0 + self.timeout - time.monotonic())
        except asyncio.TimeoutError:
            raise TimeoutError(f"trainer resize to {n} rank(s): trainer ranks {self.peers.missing(n)} "
                               "did not report in time (launcher.start_timeout + step_timeout)") from None
        regroup(n)
        for worker in sorted(self.peers.reward_workers):  # before any Route that names a new rank
            await self.peers.send(worker.encode(), Trainers(n))
        seconds = time.monotonic() - t0
        self.ledger.write("scale", trainers={"from": before, "to": n}, step=step, checkpoint=path,
                          seconds=round(seconds, 3))
        self.metrics.log("resize", step=step, trainers_before=before, trainers=n, checkpoint=path, seconds=seconds)
        resize.answer(self.run_dir, resize.DONE, ask["id"], n=n, seconds=round(seconds, 3))
        held, self.held, self.asked = self.held, None, None
        return held
