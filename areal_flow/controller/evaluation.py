"""Held-out accuracy through the generation servers: greedy, one request per prompt."""

from __future__ import annotations

import asyncio
from typing import Callable

from areal_flow.generation.router import ServerPool


async def held_out_accuracy(
    pool: ServerPool,
    tokenizer,
    rows: list[dict[str, str]],
    reward_fn: Callable[[str, str], float],
    prompt_key: str,
    reference_key: str,
    max_new_tokens: int,
) -> float:
    """The fraction of `rows` whose greedy answer the reward function scores 1 or more. The prompts
    go through the pool as the rollout workers' do: spread by load over the servers, retried on
    another server when one fails (a server down at evaluation time does not fail the run)."""
    params = {"max_new_tokens": max_new_tokens, "temperature": 0.0}
    answers = await asyncio.gather(*[
        pool.generate(tokenizer.encode(row[prompt_key], add_special_tokens=False), params, return_logprob=False)
        for row in rows])
    texts = [tokenizer.decode(answer["output_ids"], skip_special_tokens=True) for answer in answers]
    correct = sum(reward_fn(text, row[reference_key]) >= 1.0 for text, row in zip(texts, rows))
    return correct / len(rows)
