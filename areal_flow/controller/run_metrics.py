"""Run metrics: one clock that pauses for evaluation, per-process traffic, and the step record.

The step record is computed from metadata only (rewards, lengths, token versions); everything here
is plain values and pure functions, tested without sockets.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from areal_flow.algorithms.diagnostics import (
    BEHAV_WEIGHT_BIN,
    LENGTH_BUCKETS,
    behav_weight_edges,
    ess_fraction,
    length_bucket_metrics,
    length_buckets,
    mismatch_metrics,
    staleness_metrics,
)
from areal_flow.graph.keys import JUDGE_STATS
from areal_flow.transport.messages import Finish, GroupMeta

BIN_PREFIX = BEHAV_WEIGHT_BIN.split("{")[0]


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


SUMMED = frozenset({"agent/dropped_tokens"})
"""Sample scalars a step sums instead of averaging."""


def _logged_name(scalar: str, judges: Sequence[str]) -> str:
    """The name a sample's scalar is logged under: a multi-turn trajectory's (env/..., rollout/turns.py)
    and an agent's (agent/..., agents/runner.py) as they are, a judge's under judge/, the reward
    nodes' under reward/."""
    if scalar.startswith(("env/", "agent/")):
        return scalar
    judged = {f"{j}_{stat}" for j in judges for stat in JUDGE_STATS}
    return f"judge/{scalar}" if scalar in judged else f"reward/{scalar}"


def batch_metrics(groups: list[GroupMeta], step: int, reward_key: str, output_key: str,
                  max_new_tokens: int | None = None, judges: Sequence[str] = ()) -> dict:
    """Reward, accuracy, realised staleness (step − version of each trained token) and lengths.

    staleness_hist counts tokens by age (item a: the tokens of age a); staleness_seq_hist counts
    answers, each once, by the age of its oldest token (step − its smallest version; answers
    without versions are not counted). With `max_new_tokens`, by_length/reward/qK and
    by_length/samples/qK: the mean reward and the number of the answers in each quarter of the
    generation budget by length (diagnostics.length_buckets; None for an empty quarter). The
    scalars of the judges named in `judges` (`<judge>_seconds`, ...) go out as judge/<judge>_<stat>."""
    samples = [s for g in groups for s in g.samples]
    rewards = np.array([s.scalars[reward_key] for s in samples], dtype=np.float64)
    hist: dict[int, int] = {}
    for s in samples:
        for version, n in s.versions.items():
            hist[step - version] = hist.get(step - version, 0) + n
    seq_ages = np.array([step - min(s.versions) for s in samples if s.versions], dtype=np.int64)
    ages = np.array(sorted(hist), dtype=np.int64)
    counts = np.array([hist[a] for a in ages], dtype=np.int64)
    # A reward node's statistics may be missing from a sample (a timed-out sample has no
    # tests_passed): each is averaged over the samples that have it.
    keys = sorted({k for s in samples for k in s.scalars} - {reward_key})
    per_key = {k: float((np.sum if k in SUMMED else np.mean)([s.scalars[k] for s in samples if k in s.scalars]))
               for k in keys}
    if "agent/calls" in per_key and "agent/drifts" in per_key:  # drifts per call of the step, not a mean of ratios
        calls = sum(s.scalars.get("agent/calls", 0.0) for s in samples)
        per_key["agent/drift_rate"] = sum(s.scalars.get("agent/drifts", 0.0) for s in samples) / calls if calls else 0.0
    lengths = np.array([s.lengths[output_key] for s in samples], dtype=np.float64)
    by_length = reward_by_length(lengths, rewards, max_new_tokens) if max_new_tokens else {}
    suspect = suspect_metrics(samples)
    return {
        "reward": float(rewards.mean()),
        "accuracy": float((rewards >= 1).mean()),
        **{_logged_name(k, judges): v for k, v in per_key.items()},
        **suspect,
        "staleness_mean": float((ages * counts).sum() / counts.sum()) if counts.sum() else 0.0,
        "staleness_max": int(ages.max()) if len(ages) else 0,
        "staleness_hist": np.bincount(ages, weights=counts, minlength=1).astype(int).tolist() if len(ages) else [0],
        "staleness_seq_hist": np.bincount(seq_ages, minlength=1).tolist() if len(seq_ages) else [0],
        "response_length": float(lengths.mean()),
        "response_length_std": float(lengths.std()),
        "response_length_max": int(lengths.max()),
        "truncated_fraction": float(np.mean([s.finish != Finish.STOP for s in samples])),
        **by_length,
    }


def suspect_metrics(samples: list) -> dict:
    """reward/suspect: the share of the samples that any reward node flagged as suspect (its
    `<node>_suspect` scalar, docs/rewards.md), and reward/suspect_samples their number; nothing when
    no reward node flags samples (no code or math reward in the graph)."""
    flags = [[v for k, v in s.scalars.items() if k.endswith("_suspect")] for s in samples]
    if not any(flags):
        return {}
    n = sum(any(v > 0 for v in f) for f in flags)
    return {"reward/suspect": n / len(samples), "reward/suspect_samples": n}


def reward_by_length(lengths: np.ndarray, rewards: np.ndarray, max_new_tokens: int) -> dict:
    """by_length/reward/qK (the mean reward; None for an empty bucket) and by_length/samples/qK
    over the answers in each quarter of max_new_tokens by length."""
    buckets = length_buckets(lengths, max_new_tokens)
    out: dict = {}
    for k, name in enumerate(LENGTH_BUCKETS):
        out[f"by_length/reward/{name}"] = float(rewards[buckets == k].mean()) if np.any(buckets == k) else None
    for k, name in enumerate(LENGTH_BUCKETS):
        out[f"by_length/samples/{name}"] = int(np.sum(buckets == k))
    return out


def train_metrics(stats: dict[str, float], behav_weight_cap: float | None = None,
                  behav_weight_floor: float | None = None) -> dict:
    """A step's metrics from the trainer ranks' stats (StepDone.stats, already summed over
    micro-batches, minibatches and ranks): every stat as train/<key>, except the raw sums of the
    step's diagnostics (algorithms/diagnostics.py), which are finished here instead:

        train/behav_weight_hist        the behaviour weight w = π_prox/π_behav of each valid token
                                       the loss ran (before its cap and floor), counted per bin
        train/behav_weight_hist_edges  its n+1 edges: diagnostics.behav_weight_edges(cap, floor)
        train/capped_fraction          capped_tokens / N: the share of tokens outside [floor, cap]
        train/ess_fraction             (Σw)² / (N·Σw²), 1 when every weight is equal
        by_length/advantage/qK         the mean over the bucket's answers of their mean advantage
        by_length/loss_share/qK        the bucket's share of Σ |A|·token weight (the length bias)
        stale/<d>/...                  by versions behind π_prox: tokens, weight_mean, weight_max,
                                       capped_fraction, grad_share (diagnostics.staleness_metrics)
        mismatch/..., mismatch/<d>/... log π_start − log π_behav, all tokens and by versions behind:
                                       abs_mean, abs_p99, abs_max, k3, past_fraction, tokens
                                       (diagnostics.mismatch_metrics)

    N is the number of tokens in the histogram (the valid tokens the loss ran, every minibatch
    and epoch), or n_valid_tokens − skipped_tokens when the loss gave no histogram. Keys whose
    inputs are missing (a loss function of one's own, the critic's stats) are left out."""
    row = {f"train/{k}": v for k, v in stats.items()
           if not k.startswith((BIN_PREFIX, "by_length/", "stale/", "mismatch/"))}
    if hist := behav_weight_hist(stats):
        row["train/behav_weight_hist"] = hist
        edges = behav_weight_edges(behav_weight_cap, behav_weight_floor)
        if len(edges) == len(hist) + 1:
            row["train/behav_weight_hist_edges"] = edges
        n = float(sum(hist))
    else:
        n = stats.get("n_valid_tokens", 0.0) - stats.get("skipped_tokens", 0.0)
    if "capped_tokens" in stats:
        row["train/capped_fraction"] = stats["capped_tokens"] / n if n > 0 else None
    if "behav_weight_sq_sum" in stats and "behav_weight_sum" in stats:
        row["train/ess_fraction"] = ess_fraction(stats["behav_weight_sum"], stats["behav_weight_sq_sum"], n)
    row.update(length_bucket_metrics(stats))
    row.update({f"train/{k}": v for k, v in staleness_metrics(stats).items()})
    row.update({f"train/{k}": v for k, v in mismatch_metrics(stats).items()})
    return row


def behav_weight_hist(stats: dict[str, float]) -> list[int]:
    """The behaviour weight histogram's counts (item i = bin i) from its per-bin stats
    (diagnostics.BEHAV_WEIGHT_BIN), [] when there are none."""
    n = sum(1 for k in stats if k.startswith(BIN_PREFIX))
    return [int(round(stats[BEHAV_WEIGHT_BIN.format(i)])) for i in range(n)]


def reward_busy(groups: list[GroupMeta], nodes, seconds: float) -> dict[str, float]:
    """Per reward node, the busy fraction of its worker pool over a step: the seconds its function
    ran for the step's samples over workers × the step's wall time (well under 1: the rewards keep
    up with generation)."""
    samples = [s for g in groups for s in g.samples]
    return {f"reward_busy/{n.name}": sum(s.scalars.get(f"{n.name}_seconds", 0.0) for s in samples) / (n.workers * seconds)
            for n in nodes if seconds > 0}


def reward_wait(groups: list[GroupMeta], waited_from: float) -> float:
    """Seconds of the trainer's wait for a batch that went to its rewards: from when the batch's
    last group was generated (or the trainer began to wait, if later) to when its last group was
    scored; 0 when the rewards were done before the trainer asked. `waited_from` and the groups'
    stage times are wall clock (time.time()), each stamped by the process of that stage."""
    stages = [g.times for g in groups if "scored" in g.times]
    if not stages:
        return 0.0
    generated = max(t.get("judged", t.get("generated", t["scored"])) for t in stages)
    return max(0.0, max(t["scored"] for t in stages) - max(generated, waited_from))
