"""The end of a run as the controller records it: why it ended (`stop_reason`: a machine-readable
kind and a sentence, in summary.json, the `summary` row and, for a failure, a `failure` row of
metrics.jsonl), and the run's summary. The launcher prints the sentence on the console
(launchers/progress.py) and the summary table shows it.

Kinds: `total_steps` (the run trained them all), `wall_time` (max_wall_seconds of training passed),
`stop_request` (SIGUSR1: the launcher sends it on Ctrl-C or SIGTERM, a Slurm job before its time
limit, to stop with a checkpoint) and
`failure` (an exception ended the controller: a stalled run, a process that died, any error). The
training prompts never run out (controller/prompts.py starts another shuffled pass), so no run ends
on its dataset.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from areal_flow.checkpoint import store
from areal_flow.runtime import run_dir as rd

if TYPE_CHECKING:
    from areal_flow.config.schema import RunConfig
    from areal_flow.controller.state import RunState
    from areal_flow.metrics.writer import MetricsWriter

STOP_KINDS = ("total_steps", "wall_time", "stop_request", "failure")


def stop_reason(kind: str, message: str) -> dict[str, str]:
    assert kind in STOP_KINDS, kind
    return {"kind": kind, "message": message}


def why_it_ended(cfg: RunConfig, steps: int, *, wall_time: bool) -> dict[str, str]:
    """The stop reason of a step loop that ended after `steps` steps; `wall_time`: it stopped at the
    wall-time limit. Short of both, only a stop request ends the loop."""
    total = cfg.total_steps
    if steps >= total:
        return stop_reason("total_steps", f"total_steps={total} reached")
    if wall_time:
        return stop_reason("wall_time", f"max_wall_seconds={cfg.max_wall_seconds:g} reached after {steps} of "
                                        f"{total} steps")
    return stop_reason("stop_request", f"stop requested (SIGUSR1: {_who_stops(cfg)}) after {steps} of {total} steps")


def _who_stops(cfg: RunConfig) -> str:
    """Who sends the controller SIGUSR1 under the run's launcher."""
    if cfg.launcher.type == "slurm":
        return (f"the Slurm job's, {cfg.launcher.slurm_stop_before} s before launcher.slurm_time's limit or by "
                "`scancel --batch --signal=USR1`")
    return "the launcher's Ctrl-C or SIGTERM"


def failure(error: BaseException) -> dict[str, str]:
    """The stop reason of an exception that ended the controller: its type and message, on one line."""
    text = " ".join(str(error).split()) or "(no message)"
    return stop_reason("failure", f"{type(error).__name__}: {text}")


def run_summary(state: RunState, group_size: int, run_dir: str, steps: int, *, stopped: bool,
                accuracy: tuple[float | None, float | None], train_wall: float, checkpoint: str | None,
                reason: dict[str, str]) -> dict:
    """summary.json: what the run did (`state`, the run state at its end), how it ended, where its
    checkpoints are. `stopped`: it ended on a stop request before total_steps, without the end's
    evaluation and export."""
    trained = state.trained_groups()
    return {
        "steps": steps,
        "stopped": stopped,
        "stop_reason": reason,
        "resumes": state.resumes,
        "accuracy_start": accuracy[0],
        "accuracy_end": accuracy[1],
        "train_wall_seconds": train_wall,
        "trained_samples": trained * group_size,
        "samples_per_second": trained * group_size / train_wall if train_wall else 0.0,
        "trainer_busy_fraction": state.trainer_seconds / train_wall if train_wall else 0.0,
        "admitted_groups": state.next_group,
        "trained_groups": trained,
        "running_groups_at_end": len(state.staleness.running),
        "buffered_groups_at_end": len(state.intake),
        "dropped_groups": state.intake.dropped,
        "filtered_groups": state.filtered,
        "checkpoint": checkpoint,
        "resumable_checkpoint": store.latest(run_dir),
    }


def record_failure(metrics: MetricsWriter, error: BaseException) -> dict[str, str]:
    """Log the failure that ends the run as its `failure` row; its stop reason."""
    reason = failure(error)
    try:
        metrics.log("failure", stop_reason=reason)
    except ValueError:  # metrics.jsonl already closed: the run failed after its summary, in its shutdown
        pass
    return reason


def write_summary(metrics: MetricsWriter, run_dir: str, summary: dict) -> None:
    """The summary as the `summary` row and as RUN_DIR/summary.json."""
    metrics.log("summary", **summary)
    with open(os.path.join(run_dir, rd.SUMMARY), "w") as f:
        json.dump(summary, f, indent=2)
