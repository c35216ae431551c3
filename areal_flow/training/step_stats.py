"""A train step's statistics: the loss function's, added over micro-batches and ranks, and the
engine's own (gradient norm, LR, counts, seconds), the same keys from every engine."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from areal_flow.metrics.profile import Phases
from areal_flow.training.micro_batches import StepBatch


def accumulate_stats(into: dict[str, float], stats: dict) -> None:
    """Add `stats` into `into`: keys ending in _max (and grad_norm) keep the largest, others sum.
    Tensor values come to the host in one copy: a loss's statistics (the behaviour weight's
    histogram bins among them) would otherwise cost one device synchronisation each."""
    accumulate_all_stats(into, [stats])


def accumulate_all_stats(into: dict[str, float], all_stats: Sequence[dict]) -> None:
    """`accumulate_stats` of each of `all_stats` in order, with every tensor value of all of them
    brought to the host in ONE copy: an engine keeps its micro-batches' statistics on the device
    and reads them once per step, not once per micro-batch (each read is a device
    synchronisation: the host waits for the backward and the GPU for the next forward's launch).
    The same float64 values in the same order as one `accumulate_stats` per micro-batch."""
    where = [(i, k) for i, stats in enumerate(all_stats) for k, v in stats.items() if isinstance(v, torch.Tensor)]
    host_stats = [dict(stats) for stats in all_stats]
    if where:
        device = all_stats[where[0][0]][where[0][1]].device
        host = torch.stack([all_stats[i][k].detach().reshape(()).to(device, torch.float64) for i, k in where]).tolist()
        for (i, k), value in zip(where, host):
            host_stats[i][k] = value
    for stats in host_stats:
        _accumulate_host(into, stats)


def _accumulate_host(into: dict[str, float], stats: dict) -> None:
    for key, value in stats.items():
        value = float(value)
        if key not in into:
            into[key] = value
        elif key.endswith("_max") or key == "grad_norm":
            into[key] = max(into[key], value)
        else:
            into[key] += value


def merge_stats(sums: dict[str, float], group: dist.ProcessGroup | None) -> dict[str, float]:
    """Merges the ranks' stat sums (max for `_max` keys). A rank without data has no keys, so the
    dicts are gathered as objects rather than reduced as one tensor of agreed layout."""
    if group is None:
        return sums
    gathered: list[dict[str, float] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, sums, group=group)
    merged: dict[str, float] = {}
    for part in gathered:
        accumulate_stats(merged, part or {})
    return merged


def step_report(sums: dict[str, float], batch: StepBatch, *, grad_norm: float, lr: float, skipped: bool,
                n_micro_batches: int, start: float, phases: Phases) -> dict[str, float]:
    """`sums` (the loss statistics, merged over ranks) with the engine's keys, which take precedence:
    the gradient norm before clipping, the LR the step used, whether it was skipped (non-finite),
    the micro-batches per rank, the step's global token counts, and this rank's own seconds since
    `start` and phase timings (not summed over ranks)."""
    sums.update(grad_norm=grad_norm, lr=lr, skipped_steps=float(skipped), n_micro_batches=float(n_micro_batches),
                n_tokens=float(batch.n_tokens), n_valid_tokens=float(batch.n_valid),
                step_seconds=time.perf_counter() - start, **phases.reset())
    return sums
