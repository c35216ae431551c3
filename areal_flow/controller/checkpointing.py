"""Resumable checkpoints of a run (checkpoint/store.py), and the trained model at its end.

A checkpoint is taken between steps, with no weights in flight: the run state as encoded then,
and each trainer rank's models and the scored groups the state places on it. Whatever happens
while the ranks write (groups finishing) is after it, so a resumed run does it again.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable

from areal_flow.checkpoint import store
from areal_flow.config.schema import CheckpointConfig
from areal_flow.controller import state as run_state
from areal_flow.controller.peers import Peers
from areal_flow.controller.run_metrics import RunClock
from areal_flow.controller.watchdog import Progress, Wait
from areal_flow.metrics.writer import MetricsWriter
from areal_flow.runtime import run_dir as rd
from areal_flow.runtime.disk import writing
from areal_flow.transport.messages import SaveCheckpoint, Saved

log = logging.getLogger("areal_flow.controller")


class Checkpoints:
    def __init__(self, cfg: CheckpointConfig, run_dir: str, peers: Peers, clock: RunClock, metrics: MetricsWriter,
                 progress: Progress, *, saved: tuple[int, float] = (0, 0.0), path: str | None = None):
        """`saved`, `path`: the last checkpoint (its step and training clock, its folder), a resumed
        run's own."""
        self.cfg, self.run_dir, self.peers, self.clock = cfg, run_dir, peers, clock
        self.metrics, self.progress = metrics, progress
        self.saved, self.path = saved, path

    def due(self, step: int) -> bool:
        """Whether the state after `step` steps is saved: every checkpoint.every_steps steps, or once
        checkpoint.every_minutes of training passed since the last checkpoint."""
        every, minutes = self.cfg.every_steps, self.cfg.every_minutes
        return bool(every and step % every == 0) or \
            bool(minutes and self.clock.elapsed() - self.saved[1] >= 60 * minutes)

    def of_step(self, step: int) -> str | None:
        """The last checkpoint's folder if it is of `step`."""
        return self.path if self.saved[0] == step and self.path else None

    async def save(self, step: int, snapshot: Callable[[], tuple[bytes, int, dict[int, list[int]]]],
                   files: dict[str, bytes] | None = None) -> str:
        """A resumable checkpoint after `step` steps; `snapshot()`: the run state encoded now, its
        policy version and the scored groups each rank holds (it saves them beside its models);
        `files`: more of the controller's, by name (the trajectories in flight: controller/kept.py)."""
        self.progress.waits(Wait.CHECKPOINT, step=step)
        t0 = time.monotonic()
        encoded, version, held = snapshot()
        tmp = store.begin(self.run_dir, step)
        await self.peers.ask(lambda rank: SaveCheckpoint(tmp, held[rank]), Saved, f"saving the checkpoint of step {step}")
        with writing("the checkpoint", tmp):
            for name, data in {run_state.FILE: encoded, **(files or {})}.items():
                with open(os.path.join(tmp, name), "wb") as f:
                    f.write(data)
            shutil.copy(os.path.join(self.run_dir, rd.CONFIG), os.path.join(tmp, rd.CONFIG))
            path = store.commit(tmp, step, version=version, n_trainers=len(self.peers.ranks))
        removed = store.prune(self.run_dir, self.cfg.keep_last)
        self.saved, self.path = (step, self.clock.elapsed()), path
        seconds = time.monotonic() - t0
        size = sum(store.read_manifest(path)["files"].values())
        self.metrics.log("checkpoint", step=step, path=path, seconds=seconds, bytes=size, removed=removed)
        log.info("checkpoint of step %d: %s (%.1f MB, %.2f s)", step, path, size / 1e6, seconds)
        self.progress.made()
        return path

    async def export(self, path: str) -> str:
        """The trained model as a Hugging Face directory at `path`, at the end of the run."""
        await self.peers.ask(lambda rank: SaveCheckpoint(path), Saved, "saving the checkpoint")
        return path
