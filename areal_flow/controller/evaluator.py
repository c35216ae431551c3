"""The held-out evaluation as the step loop runs it (the measuring itself is `evaluation.py`):

- at the start and the end of the run, with training time stopped meanwhile;
- beside training, every `eval.every_versions` versions: on that version's weights, while the
  trainer trains on. The servers stay at that version until it ends (`VersionPin`: the next load
  waits), one evaluation at a time (a version due while one runs is skipped). Colocated,
  generation and training take turns on the devices, so it runs in generation's turn, before the
  next step.

Each evaluation is an `eval` row of metrics.jsonl and a file of every answer (`evals/`). The
reward workers it scores with start at the first evaluation.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from areal_flow.config.schema import RunConfig
from areal_flow.controller.evaluation import Evaluation, VersionPin, held_out_accuracy, write_answers
from areal_flow.controller.run_metrics import RunClock
from areal_flow.controller.watchdog import Progress, Wait
from areal_flow.generation.client.router import ServerPool
from areal_flow.metrics.writer import MetricsWriter
from areal_flow.rewards.service import AGENT_FN, RewardService

log = logging.getLogger("areal_flow.controller")


class Evaluator:
    def __init__(self, cfg: RunConfig, graph, pool: ServerPool, tokenizer, rows: list[dict[str, str]], turns, *,
                 run_dir: str, metrics: MetricsWriter, clock: RunClock, progress: Progress,
                 wake: Callable[[], None]):
        """`graph`: the run's (its evaluation reward, prompt and reference keys, colocation);
        `pool`: the policy's servers; `turns`: a multi-turn generate node's runner, or an agent's;
        `wake`: called when an evaluation beside training ends (the step loop sees a failure)."""
        self.cfg, self.graph, self.pool, self.tokenizer, self.rows, self.turns = cfg, graph, pool, tokenizer, rows, turns
        self.colocated = graph.colocated
        self.run_dir, self.metrics, self.clock, self.progress, self.wake = run_dir, metrics, clock, progress, wake
        self.rewards: RewardService | None = None  # the evaluation's reward workers, from the first one
        self.pin = VersionPin()  # the version an evaluation beside training holds the servers at
        self.task: asyncio.Task | None = None  # that evaluation
        self.steps_trained = 0  # train steps this process ran: an evaluation's row counts those meanwhile

    def step_trained(self) -> None:
        self.steps_trained += 1

    async def at(self, when: str, version: int) -> float:
        """Held-out greedy accuracy at the start or end of the run; training time stops meanwhile."""
        self.progress.waits(Wait.EVALUATION, when=when)
        with self.clock.paused():
            return await self.held_out(when, version, self.steps_trained)

    def due(self, version: int) -> bool:
        every = self.cfg.eval.every_versions
        return bool(every) and version % every == 0

    async def beside(self, version: int) -> bool:
        """Start the evaluation of `version`'s weights, loaded now, beside training; whether it ran to
        its end here (colocated: its time is not training time, so the step's rates restart after it)."""
        if self.pin.held:  # held from the start of an evaluation to its end
            log.warning("held-out evaluation at version %d skipped: the one at version %s still runs",
                        version, self.pin.version)
            self.metrics.log("eval_skipped", step=version, version=version, running=self.pin.version)
            return False
        self.pin.hold(version)

        async def run(steps_before: int) -> None:
            try:
                await self.held_out(f"version {version}", version, steps_before)
            finally:
                self.pin.release()

        self.task = asyncio.create_task(run(self.steps_trained))
        self.task.add_done_callback(lambda _: self.wake())
        if self.colocated:
            await self.task
        return self.colocated

    def check(self) -> None:
        """Raise the error of an evaluation beside training that failed."""
        if self.task is not None and self.task.done() and not self.task.cancelled():
            self.task.result()

    async def before_load(self, version: int) -> None:
        """Hold the load of `version` until the evaluation pinned to the servers' version ends."""
        if self.pin.held:
            self.progress.waits(Wait.PINNED_LOAD, pinned=self.pin.version, version=version)
            await self.pin.wait()

    async def last(self) -> None:
        """Wait for the evaluation beside training still running at the end of the step loop: its
        row belongs to the run."""
        if self.task is not None:
            self.progress.waits(Wait.EVALUATION, when=f"version {self.pin.version}")
            await self.task

    async def held_out(self, when: str, version: int, steps_before: int) -> float:
        """Evaluate on the servers' current weights (`version`) and log the `eval` row: accuracy,
        the versions the answers came from, the train steps since `steps_before` and a few answers."""
        t0, graph = time.monotonic(), self.graph
        reward = graph.eval_reward  # a reward with a dataset reference: evaluation calls no judge
        if self.rewards is None:  # worker processes start at the first evaluation
            self.rewards = RewardService([reward], self.cfg.sandbox)

        async def score(text: str, reference: str) -> float:
            return (await self.rewards.score(reward.name, text, reference)).raw

        result: Evaluation = await held_out_accuracy(
            self.pool, self.tokenizer, self.rows, score, graph.dataset_input(graph.generate), graph.reference(reward),
            self.cfg.algorithm.max_new_tokens, self.turns, reward.fn == AGENT_FN)
        write_answers(self.run_dir, version, result.answers)
        if set(result.versions) != {version}:
            log.warning("held-out evaluation at %s: answers came from versions %s, not only %d", when,
                        result.versions, version)
        self.metrics.log("eval", when=when, step=version, version=version, accuracy=result.accuracy, n=result.n,
                         answer_versions={str(v): n for v, n in sorted(result.versions.items())},
                         trainer_steps_meanwhile=self.steps_trained - steps_before,
                         seconds=time.monotonic() - t0, samples=result.samples, **result.figures)
        log.info("held-out accuracy at %s: %.1f%%", when, 100 * result.accuracy)
        return result.accuracy

    def close(self) -> None:
        if self.rewards is not None:
            self.rewards.close()
