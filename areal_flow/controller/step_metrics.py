"""A step's window and its metrics row.

A step's window runs from the end of the previous step to the end of this one: its seconds, what
the generation servers counted over it (`publisher.server_counts`, each judge's as
`<judge>/<count>`) and the controller's CPU seconds. A step's row then covers the step's own
training and what generation did meanwhile, the previous step's weight load too (its own load comes
after, and is in the row as `update_seconds`). The row is written once the step's weights are
loaded, with the alarms that watch it (staleness trouble, suspected reward hacking).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from areal_flow.algorithms.correction_table import configured_bounds
from areal_flow.config.schema import AlgorithmConfig
from areal_flow.controller.run_metrics import Traffic, batch_metrics, reward_busy, train_metrics
from areal_flow.controller.suspect_alarm import SuspectAlarm
from areal_flow.controller.watchdog import Progress, Wait
from areal_flow.controller.weight_alarm import WeightAlarm
from areal_flow.generation.compute_counts import COMPUTE_COUNTS
from areal_flow.metrics.writer import MetricsWriter
from areal_flow.transport.channels import sent_bytes
from areal_flow.transport.messages import GroupMeta

log = logging.getLogger("areal_flow.controller")


@dataclass
class Window:
    """A step's window: its seconds, the servers' counts over it, the controller's CPU seconds in it."""

    seconds: float = 0.0
    servers: dict[str, float] = field(default_factory=dict)
    cpu: float = 0.0


@dataclass
class Batch:
    """The groups a step trains: group id -> (metadata, rank holding it, tokens)."""

    groups: dict[int, tuple[GroupMeta, int, int]]
    reward_wait: float = 0.0  # seconds of the wait for it that went to rewards (run_metrics.reward_wait)

    @property
    def metas(self) -> list[GroupMeta]:
        return [meta for meta, _, _ in self.groups.values()]


@dataclass
class Trained:
    """A trained step, until its weights are loaded and its metrics row written."""

    step: int
    batch: Batch
    stats: dict[str, float]
    seconds: float  # the trainer's step, dispatch to the last rank's reply
    at: float  # training-clock seconds when it ended
    window: Window = field(default_factory=Window)
    weights: str = ""  # where its weights are (the trainer's answer), to load on the servers
    update: asyncio.Task | None = None  # loading its weights on the generation servers


def drift_warning(row: dict) -> str:
    """The run's warning at the first step whose agents drifted (the rollout worker's log shows an example)."""
    return (f"step {row['step']}: agent calls drifted ({row.get('agent/drift_rate', 0.0):.1%} of the step's calls): "
            f"{int(row.get('agent/dropped_tokens', 0))} policy tokens of their earlier segments were not trained "
            "(agent/dropped_tokens); the rollout worker's log shows where one history left the recorded tokens "
            "(docs/agents.md, Drift)")


class StepMetrics:
    def __init__(self, algo: AlgorithmConfig, metrics: MetricsWriter, progress: Progress,
                 counts: Callable[[], Awaitable[dict[str, float]]], *, reward_key: str, output_key: str,
                 max_staleness: int, suspect_warn, judges: Sequence[str] = (), reward_nodes: Sequence = ()):
        """`counts`: the servers' running counts so far (a window is their difference);
        `max_staleness`, `suspect_warn`: the alarms' settings (rollout.max_staleness,
        metrics.suspect_warn); `judges`: the judge nodes' names; `reward_nodes`: the graph's reward
        nodes (their workers' busy share)."""
        self.algo, self.metrics, self.progress, self.counts = algo, metrics, progress, counts
        self.reward_key, self.output_key = reward_key, output_key
        self.judges, self.reward_nodes = list(judges), list(reward_nodes)
        self.traffic = Traffic()  # bytes each process sent, reported in its messages
        self.weight_alarm = WeightAlarm(algo.stale_warn_capped, algo.stale_warn_ess, algo.stale_warn_steps,
                                        max_staleness)
        self.suspect_alarm = SuspectAlarm(suspect_warn)
        self.drift_warned = False  # agents' drift: warned once a run
        # Where the next step's window starts: monotonic time, the servers' counts, controller CPU seconds.
        self.mark: tuple[float, dict[str, float], float] = (0.0, {}, 0.0)

    async def restart(self) -> None:
        """The next step's window starts now (after time that is not training time)."""
        self.mark = (time.monotonic(), await self.counts(), time.process_time())

    async def end(self) -> Window:
        """A step has trained: its window ends now, and the next step's starts."""
        self.progress.waits(Wait.SERVER_COUNTS)
        (last, before, cpu), now, counts = self.mark, time.monotonic(), await self.counts()
        self.mark = (now, counts, time.process_time())
        return Window(now - last, {key: value - before[key] for key, value in counts.items() if key in before},
                      time.process_time() - cpu)

    def row(self, done: Trained, update_seconds: float, samples: int, generated_tokens: int, run: dict) -> dict:
        """The step's metrics row; `samples`: answers a step trains (batch × group size);
        `generated_tokens`: answer tokens generated since the last row; `run`: the run's own figures,
        last in the row (elapsed, buffered, running, ...)."""
        step, stats, train_seconds, metas, algo = done.step, done.stats, done.seconds, done.batch.metas, self.algo
        seconds, servers, cpu = done.window.seconds, done.window.servers, done.window.cpu
        self.traffic.report("controller", sent_bytes())
        return dict(
            step=step + 1,
            **batch_metrics(metas, step, self.reward_key, self.output_key, max_new_tokens=algo.max_new_tokens,
                            judges=self.judges),
            **reward_busy(metas, self.reward_nodes, seconds),
            # train/<stat>, and the step's diagnostics finished from their sums (by_length/*, histograms)
            **train_metrics(stats, *reversed(configured_bounds(algo))),
            **{f"sent_bytes/{p}": n for p, n in self.traffic.step().items()},
            step_seconds=seconds, train_seconds=train_seconds, update_seconds=update_seconds, trained_at=done.at,
            samples_per_second=samples / seconds, gen_tokens_per_second=generated_tokens / seconds,
            train_tokens_per_second=stats.get("n_tokens", 0.0) / train_seconds,
            trainer_idle=1 - train_seconds / seconds,
            trainer_reward_wait=done.batch.reward_wait / seconds,
            generator_idle=1 - servers["busy_seconds"] / seconds if "busy_seconds" in servers else None,
            generator_load=servers["load_seconds"] / seconds if "load_seconds" in servers else None,
            # Each judge's servers' idle share of the step, as generator_idle (SGLang reports none).
            **{f"judge_idle/{j}": 1 - servers[f"{j}/busy_seconds"] / seconds for j in self.judges
               if f"{j}/busy_seconds" in servers},
            **{f"gen/{key}": servers[key] for key in (*COMPUTE_COUNTS, "memory_releases") if key in servers},
            controller_cpu_fraction=cpu / seconds,
            **run,
        )

    def log(self, row: dict) -> None:
        """Write the step's row, and each alarm's warning it raises."""
        step = row["step"]
        warnings = [(kind, alarm.observe(row)) for kind, alarm in (("staleness", self.weight_alarm),
                                                                   ("reward_hacking", self.suspect_alarm))]
        if row.get("agent/drifts", 0) > 0 and not self.drift_warned:  # once a run (agents/runner.py)
            self.drift_warned = True
            warnings.append(("agent_drift", drift_warning(row)))
        self.metrics.log("step", **row, stale_trouble_steps=self.weight_alarm.in_a_row)
        for kind, warning in warnings:
            if warning:
                log.warning("controller: %s", warning)
                self.metrics.log("warning", step=step, kind=kind, message=warning)
