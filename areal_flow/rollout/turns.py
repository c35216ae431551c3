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

import hashlib
from typing import Any

from areal_flow.envs.base import Environment
from areal_flow.generation.router import ServerPool
from areal_flow.rollout.requests import SEED_LIMIT, generate_sample
from areal_flow.transport.messages import Finish

# Why a trajectory ended (its `end`): the environment's done, max_turns, a turn cut at its length
# budget, no room left for another turn, or an observation that would not fit.
ENDS = ("done", "max_turns", "turn_length", "budget", "observation_too_long")


def turn_seed(seed: int | None, turn: int) -> int | None:
    """The sampling seed of a trajectory's turn: turn 0 keeps the sample's own seed, later turns draw
    fresh streams (a hash of both), so no turn replays another's random numbers."""
    if seed is None or turn == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % SEED_LIMIT


async def generate_trajectory(pool: ServerPool, env: Environment, tokenizer: Any, prompt_ids: list[int],
                              params: dict, *, max_turns: int, token_budget: int, rid: str, key: str,
                              seed: int | None = None) -> dict:
    """One trajectory's tokens and their per-token record: output_ids, behav_logprobs, versions,
    loss_mask (1: the policy's), finish (STOP unless a turn was cut at its budget), turns, end (one
    of ENDS), and the environment's figures summed over its turns (tool_calls, ...) with `env_reward`,
    the sum of its turn rewards."""
    out: dict[str, list] = {"output_ids": [], "behav_logprobs": [], "versions": [], "loss_mask": []}
    figures: dict[str, float] = {"env_reward": 0.0}
    finish, end, turns = Finish.STOP, "max_turns", 0
    try:
        while turns < max_turns:
            room = token_budget - len(prompt_ids) - len(out["output_ids"])
            if room <= 0:
                end = "budget"
                break
            turn = await generate_sample(
                pool, prompt_ids + out["output_ids"],
                {**params, "max_new_tokens": min(params["max_new_tokens"], room), "stop": list(env.stop)},
                f"{rid}-t{turns}", key, seed=turn_seed(seed, turns))
            turns += 1
            n = len(turn["output_ids"])
            for name in ("output_ids", "behav_logprobs", "versions"):
                out[name] += turn[name]
            out["loss_mask"] += [1] * n
            if turn["finish"] == Finish.LENGTH:
                finish, end = Finish.LENGTH, "turn_length"
                break
            step = await env.step(tokenizer.decode(turn["output_ids"], skip_special_tokens=False))
            for name, value in step.figures.items():
                figures[name] = figures.get(name, 0.0) + value
            figures["env_reward"] += step.reward or 0.0
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
    return {**out, "finish": finish, "turns": turns, "end": end, "figures": figures}
