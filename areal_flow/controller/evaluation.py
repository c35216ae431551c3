"""Held-out accuracy through the generation servers: greedy, one batch request per server."""

from __future__ import annotations

import asyncio
from typing import Callable

from areal_flow.generation.client import GenerationClient


async def held_out_accuracy(
    clients: list[GenerationClient],
    tokenizer,
    rows: list[dict[str, str]],
    reward_fn: Callable[[str, str], float],
    prompt_key: str,
    reference_key: str,
    max_new_tokens: int,
) -> float:
    prompts = [tokenizer.encode(r[prompt_key], add_special_tokens=False) for r in rows]
    shards = [list(range(i, len(rows), len(clients))) for i in range(len(clients))]
    params = {"max_new_tokens": max_new_tokens, "temperature": 0.0}
    answers = await asyncio.gather(
        *[c.generate_batch([prompts[i] for i in idx], params) for c, idx in zip(clients, shards) if idx]
    )
    correct = 0.0
    for idx, outs in zip(shards, answers):
        for i, out in zip(idx, outs):
            text = tokenizer.decode(out["output_ids"], skip_special_tokens=True)
            correct += reward_fn(text, rows[i][reference_key]) >= 1.0
    return correct / len(rows)
