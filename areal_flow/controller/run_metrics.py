"""Run metrics: one clock that pauses for evaluation, per-process traffic, and the step record.

The step record is computed from metadata only (rewards, lengths, token versions); everything here
is plain values and pure functions, tested without sockets.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from areal_flow.transport.messages import Finish, GroupMeta


@dataclass
class RunClock:
    """Training time: wall time since `start`, less the time spent `paused` (held-out evaluation)."""

    started: float = 0.0
    paused_seconds: float = 0.0

    def start(self, already: float = 0.0) -> None:
        """Start the clock, at `already` seconds (a resumed run's training time so far)."""
        self.started, self.paused_seconds = time.monotonic() - already, 0.0

    def elapsed(self) -> float:
        return time.monotonic() - self.started - self.paused_seconds

    @contextmanager
    def paused(self) -> Iterator[None]:
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.paused_seconds += time.monotonic() - t0


@dataclass
class Traffic:
    """Bytes each process has sent (its own running total, reported in its messages), per step."""

    total: dict[str, int] = field(default_factory=dict)
    at_last_step: dict[str, int] = field(default_factory=dict)

    def report(self, proc: str, sent_bytes: int) -> None:
        self.total[proc] = max(sent_bytes, self.total.get(proc, 0))

    def step(self) -> dict[str, int]:
        """Bytes sent by each process since the previous call."""
        delta = {p: n - self.at_last_step.get(p, 0) for p, n in sorted(self.total.items())}
        self.at_last_step = dict(self.total)
        return delta


def batch_metrics(groups: list[GroupMeta], step: int, reward_key: str, output_key: str) -> dict:
    """Reward, accuracy, realised staleness (step − version of each trained token) and lengths."""
    samples = [s for g in groups for s in g.samples]
    rewards = np.array([s.scalars[reward_key] for s in samples], dtype=np.float64)
    hist: dict[int, int] = {}
    for s in samples:
        for version, n in s.versions.items():
            hist[step - version] = hist.get(step - version, 0) + n
    ages = np.array(sorted(hist), dtype=np.int64)
    counts = np.array([hist[a] for a in ages], dtype=np.int64)
    # A reward node's statistics may be missing from a sample (a timed-out sample has no
    # tests_passed): each is averaged over the samples that have it.
    keys = sorted({k for s in samples for k in s.scalars} - {reward_key})
    per_key = {k: float(np.mean([s.scalars[k] for s in samples if k in s.scalars])) for k in keys}
    lengths = np.array([s.lengths[output_key] for s in samples], dtype=np.float64)
    return {
        "reward": float(rewards.mean()),
        "accuracy": float((rewards >= 1).mean()),
        **{f"reward/{k}": v for k, v in per_key.items()},
        "staleness_mean": float((ages * counts).sum() / counts.sum()) if counts.sum() else 0.0,
        "staleness_max": int(ages.max()) if len(ages) else 0,
        "staleness_hist": np.bincount(ages, weights=counts, minlength=1).astype(int).tolist() if len(ages) else [0],
        "response_length": float(lengths.mean()),
        "response_length_std": float(lengths.std()),
        "response_length_max": int(lengths.max()),
        "truncated_fraction": float(np.mean([s.finish != Finish.STOP for s in samples])),
    }


def reward_busy(groups: list[GroupMeta], nodes, seconds: float) -> dict[str, float]:
    """Per reward node, the busy fraction of its worker pool over a step: the seconds its function
    ran for the step's samples over workers × the step's wall time (well under 1: the rewards keep
    up with generation)."""
    samples = [s for g in groups for s in g.samples]
    return {f"reward_busy/{n.name}": sum(s.scalars.get(f"{n.name}_seconds", 0.0) for s in samples) / (n.workers * seconds)
            for n in nodes if seconds > 0}
