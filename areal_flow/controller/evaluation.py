"""Held-out accuracy through the generation servers: greedy, one request per prompt."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from areal_flow.generation.router import ServerPool


async def held_out_accuracy(
    pool: ServerPool,
    tokenizer,
    rows: list[dict[str, str]],
    score: Callable[[str, str], Awaitable[float]],
    prompt_key: str,
    reference_key: str,
    max_new_tokens: int,
) -> float:
    """The fraction of `rows` whose greedy answer `score` (the reward function's raw value, before
    shaping) puts at 1 or more. The prompts
    go through the pool as the rollout workers' do: spread by load over the servers, retried on
    another server when one fails (a server down at evaluation time does not fail the run)."""
    params = {"max_new_tokens": max_new_tokens, "temperature": 0.0}
    answers = await asyncio.gather(*[
        pool.generate(tokenizer.encode(row[prompt_key], add_special_tokens=False), params, return_logprob=False)
        for row in rows])
    texts = [tokenizer.decode(answer["output_ids"], skip_special_tokens=True) for answer in answers]
    scores = await asyncio.gather(*[score(text, row[reference_key]) for text, row in zip(texts, rows)])
    correct = sum(s >= 1.0 for s in scores)
    return correct / len(rows)
