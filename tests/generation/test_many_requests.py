"""Hundreds of concurrent requests of mixed prompts and lengths through one server: each answer is
the plain-HF greedy decode of its prompt, cut at its own length, with that decode's logprobs, while
requests join and leave the batch, wait for a KV budget, and share prefills."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from generation_helpers import VOCAB_SIZE, ModelDirs, full_forward_logprobs, greedy_reference, load_reference

from areal_flow.generation.client.generation_client import GenerationClient
from areal_flow.generation.http.server import serve

LONGEST = 40


@pytest.mark.slow  # 2 s of decoding: the fast tier is at its budget; the full suite runs it
def test_three_hundred_concurrent_requests_of_mixed_lengths_all_answer_correctly(model_dirs: ModelDirs):
    rng = random.Random(1)
    prompts = [[rng.randrange(2, VOCAB_SIZE) for _ in range(rng.randint(1, 16))] for _ in range(12)]
    cases = [(rng.randrange(len(prompts)), rng.choice([rng.randint(1, 8), rng.randint(20, LONGEST)]))
             for _ in range(300)]
    reference = load_reference(model_dirs.a)
    expected = [greedy_reference(reference, p, LONGEST, stop_ids=()) for p in prompts]
    logprobs = [full_forward_logprobs(reference, p, out, 1.0) for p, out in zip(prompts, expected)]
    # At most ~24 requests' worth of cache: most requests wait their turn.
    server, thread = serve(model_dirs.a, max_batch_size=48, max_total_tokens=24 * (16 + LONGEST))

    async def run_all() -> list[dict]:
        async with GenerationClient(server.url, max_connections=100) as client:
            return await asyncio.gather(*(
                client.generate(prompts[p], {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}, rid=f"m{i}")
                for i, (p, n) in enumerate(cases)))

    try:
        answers = asyncio.run(run_all())
        assert server.engine.is_idle() and server.engine.stats()["kv_tokens_reserved"] == 0
    finally:
        server.stop()
        thread.join()
    for i, ((p, n), answer) in enumerate(zip(cases, answers)):
        assert answer["meta_info"]["id"] == f"m{i}" and answer["output_ids"] == expected[p][:n], i
        got = torch.tensor([t[0] for t in answer["meta_info"]["output_token_logprobs"]])
        torch.testing.assert_close(got, logprobs[p][:n], atol=1e-4, rtol=0)
