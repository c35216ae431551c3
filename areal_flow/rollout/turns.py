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
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from areal_flow.config.schema import RunConfig, SandboxConfig
from areal_flow.config.validate import model_context
from areal_flow.envs.base import Environment, resolve_env
from areal_flow.generation.router import ServerPool
from areal_flow.rollout.requests import generate_group, generate_sample, turn_seed
from areal_flow.transport.messages import Finish

# Why a trajectory ended (its `end`): the environment's done, max_turns, a turn cut at its length
# budget, no room left for another turn, or an observation that would not fit.
ENDS = ("done", "max_turns", "turn_length", "budget", "observation_too_long")


async def generate_trajectory(pool: ServerPool, env: Environment, tokenizer: Any, prompt_ids: list[int],
                              params: dict, *, max_turns: int, token_budget: int, rid: str, key: str,
                              seed: int | None = None, first: dict | None = None) -> dict:
    """One trajectory's tokens and their per-token record: output_ids, behav_logprobs, versions,
    loss_mask (1: the policy's), finish (STOP unless a turn was cut at its budget), turns, end (one
    of ENDS), and the environment's figures summed over its turns (tool_calls, ...) with `env_reward`,
    the sum of its turn rewards, and the repair figures (`repairs`). `first`: turn 0, generated
    already (a group's first turns come from one request: Turns.run_group)."""
    out: dict[str, list] = {"output_ids": [], "behav_logprobs": [], "versions": [], "loss_mask": []}
    figures: dict[str, float] = {"env_reward": 0.0}
    finish, end, turns = Finish.STOP, "max_turns", 0
    rewards: list[float | None] = []  # each turn's reward from the environment (None: it gave none)
    try:
        while turns < max_turns:
            room = token_budget - len(prompt_ids) - len(out["output_ids"])
            if room <= 0:
                end = "budget"
                break
            turn = first if turns == 0 and first is not None else await generate_sample(
                pool, prompt_ids + out["output_ids"], turn_params(params, env, room), f"{rid}-t{turns}", key,
                seed=turn_seed(seed, turns))
            turns += 1
            n = len(turn["output_ids"])
            for name in ("output_ids", "behav_logprobs", "versions"):
                out[name] += turn[name]
            out["loss_mask"] += [1] * n
            if turn["finish"] == Finish.LENGTH:
                finish, end = Finish.LENGTH, "turn_length"
                break
            step = await env.step(tokenizer.decode(turn["output_ids"], skip_special_tokens=True))
            for name, value in step.figures.items():
                figures[name] = figures.get(name, 0.0) + value
            figures["env_reward"] += step.reward or 0.0
            rewards.append(step.reward)
            if step.done:
                end = "done"
                break
            if turns == max_turns:
                break  # no turn would read the observation
            observation = tokenizer.encode(step.observation, add_special_tokens=False) if step.observation else []
            if len(prompt_ids) + len(out["output_ids"]) + len(observation) >= token_budget:
                end = "observation_too_long"
                break
            version = out["versions"][-1] if out["versions"] else 0
            out["output_ids"] += observation
            out["behav_logprobs"] += [0.0] * len(observation)
            out["versions"] += [version] * len(observation)
            out["loss_mask"] += [0] * len(observation)
    finally:
        await env.close()
    return {**out, "finish": finish, "turns": turns, "end": end, "figures": {**figures, **repairs(rewards)}}


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

    @classmethod
    def of(cls, node: Any, cfg: RunConfig, model_path: str) -> "Turns | None":
        """The generate node's turns, or None when it names no environment (one turn a sample)."""
        if node.env is None:
            return None
        budget = node.max_trajectory_tokens or model_context(model_path)
        return cls(resolve_env(node.env, f"graph.{node.name}.env"), dict(node.env_settings), cfg.sandbox,
                   node.max_turns, budget)

    async def run(self, pool: ServerPool, tokenizer: Any, row: dict, prompt_ids: list[int], params: dict,
                  rid: str, key: str, seed: int | None) -> dict:
        """One trajectory from `row`, with its per-sample scalars (`scalars`)."""
        env = self.env(row, sandbox=self.sandbox, **self.settings)
        got = await generate_trajectory(pool, env, tokenizer, prompt_ids, params, max_turns=self.max_turns,
                                        token_budget=self.token_budget, rid=rid, key=key, seed=seed)
        return self.scored(got)

    async def run_group(self, pool: ServerPool, tokenizer: Any, row: dict, prompt_ids: list[int], params: dict,
                        n: int, key: str, seed: int) -> list[dict]:
        """A group's n trajectories from `row`, sample i seeded seed + i as a one-turn group's. Their
        first turns share the prompt, so they come from one request (one prefill, one round trip);
        each goes on alone from there."""
        envs = [self.env(row, sandbox=self.sandbox, **self.settings) for _ in range(n)]
        room = self.token_budget - len(prompt_ids)
        firsts = await generate_group(pool, prompt_ids, turn_params(params, envs[0], room), n, key, seed=seed) \
            if room > 0 else [None] * n
        got = await asyncio.gather(*[
            generate_trajectory(pool, env, tokenizer, prompt_ids, params, max_turns=self.max_turns,
                                token_budget=self.token_budget, rid=f"{key}-{i}", key=key, seed=seed + i, first=first)
            for i, (env, first) in enumerate(zip(envs, firsts))])
        return [self.scored(g) for g in got]

    def scored(self, got: dict) -> dict:
        """`got` with its per-sample scalars, env/<name> (every sample has each but the repair rates,
        so a step's mean is over all): turns, observation_tokens (their share of the answer), the
        environment's summed figures, and `end_<why>` 1 for why it ended, 0 for the other ENDS."""
        n = len(got["loss_mask"])
        scalars = {"turns": float(got["turns"]), "observation_tokens": (n - sum(got["loss_mask"])) / n if n else 0.0,
                   **dict.fromkeys(self.env.figures, 0.0), **got["figures"],
                   **{f"end_{end}": float(end == got["end"]) for end in ENDS}}
        got["scalars"] = {f"env/{name}": value for name, value in scalars.items()}  # logged as env/<name>
        return got
