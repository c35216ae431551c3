"""A multi-turn trajectory, token in and token out: the policy's turns and an environment's
observations, appended as tokens and never re-tokenized.

Each policy turn is one `generate_sample` (so an interruption inside a turn resubmits the tokens so
far, logprobs stitched and versions kept per token) that ends at one of the environment's stop
strings, EOS or the turn's length budget. Its text goes to the environment (envs/base.py); the
observation is tokenized alone and appended with loss mask 0, no behaviour logprob (0.0) and the
version of the turn before it (an observation is made by no policy; the ledger's staleness audit
reads it as its turn's). The trajectory ends when the environment says done, at `max_turns`, when a
turn is cut at its length budget, or when the next observation or turn would pass the trajectory's
token budget (prompt + every turn), recorded as its `end`.

An environment is the user's code, and may have bugs: an exception from its constructor, `step` or
`close` ends that trajectory only (its `end` is "env_error", its `error` the traceback's last line
and where it was raised, its scalar env/error 1). The rollout worker drops the group, naming the
error (`failed`); the controller counts the errors and stops the run past
graph.<node>.env_error_share (controller/rollout_failures.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import traceback
from collections.abc import Sequence
from typing import Any

from areal_flow.config.schema import RunConfig, SandboxConfig
from areal_flow.config.validate import model_context
from areal_flow.envs.base import Environment, Step
from areal_flow.generation.client.router import ServerPool
from areal_flow.generation.client.seeds import turn_seed
from areal_flow.rollout import live
from areal_flow.rollout.live import Keep
from areal_flow.rollout.requests import generate_group, generate_sample
from areal_flow.transport.messages import Finish, KeptTrajectory
from areal_flow.transport.trajectory import Trajectory

# Why a trajectory ended (its `end`): the environment's done, max_turns, a turn cut at its length
# budget, no room left for another turn, or an observation that would not fit.
ENDS = ("done", "max_turns", "turn_length", "budget", "observation_too_long")

ENV_ERROR = "env/error"
"""A trajectory's scalar, 1.0, where its environment raised (absent otherwise): its group is dropped."""


def error_line(e: BaseException) -> str:
    """An exception as its traceback's last line, after the place it was raised: `my_env.py:12 in
    step: KeyError: 'answer'`."""
    frames = traceback.extract_tb(e.__traceback__)
    where = f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno} in {frames[-1].name}: " if frames else ""
    return where + traceback.format_exception_only(type(e), e)[-1].strip()


async def env_step(env: Environment, turn: str) -> tuple[Step | None, str | None]:
    """The environment's answer to a turn, or the error that ends the trajectory: what `step`
    raised, or that it returned no Step (an observation that is not text included)."""
    try:
        step = await env.step(turn)
    except Exception as e:  # noqa: BLE001 - a user's environment: its bug ends this trajectory only
        return None, f"step() raised at {error_line(e)}"
    numbers = [step.reward or 0, *step.figures.values()] if isinstance(step, Step) else []
    if not isinstance(step, Step) or not isinstance(step.observation, str) or \
            not all(isinstance(v, (int, float)) for v in numbers):
        return None, f"step() returned {step!r}, not a Step (a text observation, numbers for reward and figures)"
    return step, None


async def closed(env: Environment, error: str | None) -> str | None:
    """Close `env`; the trajectory's error: `error`, or what close raised."""
    try:
        await env.close()
    except Exception as e:  # noqa: BLE001 - a user's environment: its bug ends this trajectory only
        return error or f"close() raised at {error_line(e)}"
    return error


@dataclasses.dataclass
class Ended:
    """A trajectory of an environment and how it went: why it ended (one of ENDS, or "env_error")
    and the environment's figures summed over its turns (tool_calls, ...), with `env_reward`, the
    sum of its turn rewards, and the repair figures (`repairs`)."""

    trajectory: Trajectory
    end: str
    figures: dict[str, float]


async def generate_trajectory(pool: ServerPool, env: Environment, tokenizer: Any, prompt_ids: list[int],
                              params: dict, *, max_turns: int, token_budget: int, rid: str, key: str,
                              seed: int | None = None, first: dict | None = None, kept: KeptTrajectory | None = None,
                              keep: Keep | None = None) -> Ended:
    """One trajectory: the policy's turns and the environment's observations, its finish (STOP
    unless a turn was cut at its budget) and its error (None, or what the environment raised, as
    `env_step` and `closed` say it). `first`: turn 0, generated already (a group's first turns
    come from one request: Turns.run_group). `kept`: where a checkpoint left it (live.py), to
    continue from; `keep`: called at each turn's boundary with what a checkpoint would keep."""
    trajectory = Trajectory(list(prompt_ids))
    figures: dict[str, float] = {"env_reward": 0.0}
    end, error = "max_turns", None
    rewards: list[float | None] = []  # each turn's reward from the environment (None: it gave none)
    answer: str | None = None  # the last answer's text, until the environment has read it
    keep = keep or (lambda *_: None)
    try:
        if kept is not None:
            trajectory, figures, rewards = live.resumed(kept), dict(kept.figures), list(kept.rewards)
            error = restored(env, kept.env_state)
            if not kept.stepped and trajectory.calls:  # its tool call ran when the run stopped: again
                answer = tokenizer.decode(trajectory.tokens[trajectory.answer_starts[-1]:], skip_special_tokens=True)
        while error is None:
            if answer is None:
                if trajectory.calls >= max_turns:
                    break
                room = token_budget - trajectory.n_tokens
                if room <= 0:
                    end = "budget"
                    break
                turn = first if trajectory.calls == 0 and first is not None else await generate_sample(
                    pool, trajectory.tokens, turn_params(params, env, room), f"{rid}-t{trajectory.calls}", key,
                    seed=turn_seed(seed, trajectory.calls))
                trajectory.answered(turn)
                if turn["finish"] == Finish.LENGTH:
                    end = "turn_length"
                    break
                keep(trajectory, env, figures, rewards, False)
                answer = tokenizer.decode(turn["output_ids"], skip_special_tokens=True)
            step, error = await env_step(env, answer)
            answer = None
            if error:
                break
            for name, value in step.figures.items():
                figures[name] = figures.get(name, 0.0) + value
            figures["env_reward"] += step.reward or 0.0
            rewards.append(step.reward)
            if step.done:
                end = "done"
                break
            if trajectory.calls == max_turns:
                break  # no turn would read the observation
            observation = tokenizer.encode(step.observation, add_special_tokens=False) if step.observation else []
            if trajectory.n_tokens + len(observation) >= token_budget:
                end = "observation_too_long"
                break
            trajectory.observe(observation)
            keep(trajectory, env, figures, rewards, True)
    finally:
        trajectory.error = await closed(env, error)
    return Ended(trajectory, "env_error" if trajectory.error else end, {**figures, **repairs(rewards)})


def restored(env: Environment, state: dict) -> str | None:
    """Restore a kept trajectory's environment; the error that ends the trajectory if it raised."""
    try:
        env.restore(state)
    except Exception as e:  # noqa: BLE001 - a user's environment: its bug ends this trajectory only
        return f"restore() raised at {error_line(e)}"
    return None


def turn_params(params: dict, env: Environment, room: int) -> dict:
    """A turn's sampling parameters: the environment's stop strings, and at most `room` new tokens."""
    return {**params, "max_new_tokens": min(params["max_new_tokens"], room), "stop": list(env.stop)}


def repairs(rewards: list[float | None]) -> dict[str, float]:
    """`repair_turn<k+1>` for each turn k whose environment reward says it failed (below 1) and
    that another turn followed: 1.0 when that turn's reward reached 1, else 0.0. A trajectory
    has the figure only where it failed at turn k, so a step's mean of it (each scalar is
    averaged over the samples that have it) is the share of turn-k failures fixed at turn k+1."""
    return {f"repair_turn{k + 2}": float(after is not None and after >= 1.0)
            for k, (before, after) in enumerate(zip(rewards, rewards[1:])) if before is not None and before < 1.0}


@dataclasses.dataclass(frozen=True)
class Turns:
    """How the policy's generate node runs multi-turn trajectories (its `env` and limits)."""

    env: type[Environment]
    settings: dict[str, Any]
    sandbox: SandboxConfig  # every environment gets the run's sandbox settings (`sandbox=`)
    max_turns: int
    token_budget: int
    name: str = ""  # as the recipe names it (graph.<node>.env), for messages

    @classmethod
    def of(cls, node: Any, cfg: RunConfig, model_path: str) -> "Turns | None":
        """The generate node's turns, or None when it names no environment (one turn a sample)."""
        if node.env is None:
            return None
        # Here: the built-in environments import the sandbox, which a run without one never needs.
        from areal_flow.envs.registry import resolve_env

        budget = node.max_trajectory_tokens or model_context(model_path)
        return cls(resolve_env(node.env, f"graph.{node.name}.env"), dict(node.env_settings), cfg.sandbox,
                   node.max_turns, budget, node.env)

    def make(self, row: dict, prompt_ids: list[int]) -> Environment | Ended:
        """A trajectory's environment, or (its constructor raised) the trajectory that error ends."""
        try:
            return self.env(row, sandbox=self.sandbox, **self.settings)
        except Exception as e:  # noqa: BLE001 - a user's environment: its bug ends this trajectory only
            return Ended(Trajectory(list(prompt_ids), error=f"__init__ raised at {error_line(e)}"), "env_error", {})

    async def run(self, pool: ServerPool, tokenizer: Any, row: dict, prompt_ids: list[int], params: dict,
                  rid: str, key: str, seed: int | None) -> Trajectory:
        """One trajectory from `row`, with its per-sample scalars (`scalars`)."""
        env = self.make(row, prompt_ids)
        got = env if isinstance(env, Ended) else await generate_trajectory(
            pool, env, tokenizer, prompt_ids, params, max_turns=self.max_turns, token_budget=self.token_budget,
            rid=rid, key=key, seed=seed)
        return self.scored(got)

    async def run_group(self, pool: ServerPool, tokenizer: Any, row: dict, prompt_ids: list[int], params: dict,
                        n: int, key: str, seed: int, kept: Sequence[KeptTrajectory] = (),
                        group: live.LiveGroup | None = None) -> list[Trajectory]:
        """A group's n trajectories from `row`, sample i seeded seed + i as a one-turn group's. Their
        first turns share the prompt, so they come from one request (one prefill, one round trip);
        each goes on alone from there. A trajectory whose environment could not be made is its error.
        `kept`: trajectories a checkpoint kept (live.py), each continued where it was (the group's
        first turns then come one a trajectory); `group`: where each trajectory's state is kept as
        it goes."""
        envs = [self.make(row, prompt_ids) for _ in range(n)]
        made = [env for env in envs if not isinstance(env, Ended)]
        kept_at = {k.index: k for k in kept if k.prompt_ids == list(prompt_ids) and 0 <= k.index < n}
        room = self.token_budget - len(prompt_ids)
        firsts = await generate_group(pool, prompt_ids, turn_params(params, made[0], room), n, key, seed=seed) \
            if room > 0 and made and not kept_at else [None] * n

        async def one(i: int, env: Environment | Ended, first: dict | None) -> Ended:
            return env if isinstance(env, Ended) else await generate_trajectory(
                pool, env, tokenizer, prompt_ids, params, max_turns=self.max_turns, token_budget=self.token_budget,
                rid=f"{key}-{i}", key=key, seed=seed + i, first=first, kept=kept_at.get(i),
                keep=group.keeper(i) if group is not None else None)

        got = await asyncio.gather(*[one(i, env, first) for i, (env, first) in enumerate(zip(envs, firsts))])
        return [self.scored(g) for g in got]

    def failed(self, outs: list[Trajectory]) -> str:
        """Why a group is dropped: its trajectories that ended in an error of the environment, and
        the first error; "" when none did."""
        errors = [o.error for o in outs if o.error]
        if not errors:
            return ""
        return (f"environment {self.name or self.env.__name__} raised in {len(errors)} of {len(outs)} "
                f"trajectories: {errors[0]}")

    def scored(self, got: Ended) -> Trajectory:
        """The trajectory with its per-sample scalars, env/<name> (every sample has each but the
        repair rates, so a step's mean is over all): turns, observation_tokens (their share of the
        answer), the environment's summed figures, `end_<why>` 1 for why it ended, 0 for the other
        ENDS, and `error` 1 where the environment raised (ENV_ERROR; absent otherwise: its group is
        dropped)."""
        trajectory = got.trajectory
        n, mask = len(trajectory.loss_mask), trajectory.loss_mask
        scalars = {"turns": float(trajectory.calls), "observation_tokens": (n - sum(mask)) / n if n else 0.0,
                   **dict.fromkeys(self.env.figures, 0.0), **got.figures,
                   **{f"end_{end}": float(end == got.end) for end in ENDS},
                   **({"error": 1.0} if trajectory.error else {})}
        trajectory.scalars = {f"env/{name}": value for name, value in scalars.items()}  # logged as env/<name>
        return trajectory
