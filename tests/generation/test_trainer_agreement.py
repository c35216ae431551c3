"""Generation and training must agree on logprobs at the same weights: otherwise the
behaviour weight π_prox/π_behav would be off even for fresh samples."""

import asyncio

import numpy as np
import pytest
from generation_helpers import ModelDirs

from areal_flow.generation.client.generation_client import GenerationClient
from areal_flow.generation.http.server import serve
from areal_flow.training.torch_engine import TorchEngine


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_served_logprobs_equal_the_trainers_packed_recompute(model_dirs: ModelDirs, temperature):
    server, thread = serve(model_dirs.a, max_batch_size=16)
    prompts = [[2, 3, 4], [5], [6, 7, 8, 9, 10, 11], [12, 13]]

    async def sample():
        client = GenerationClient(server.url)
        try:
            return await asyncio.gather(*[client.generate(p, {"max_new_tokens": 20, "temperature": temperature,
                                                              "ignore_eos": True}) for p in prompts])
        finally:
            await client.close()

    try:
        answers = asyncio.run(sample())
    finally:
        server.stop()
        thread.join(timeout=10)
    engine = TorchEngine(model_dirs.a, temperature=temperature, micro_batch_tokens=32)
    seqs = [(np.array(p), np.array(a["output_ids"])) for p, a in zip(prompts, answers)]
    recomputed = engine.logprobs(seqs)
    for answer, lp in zip(answers, recomputed):
        served = np.array([x[0] for x in answer["meta_info"]["output_token_logprobs"]])
        assert len(served) == 20
        np.testing.assert_allclose(served, lp, atol=2e-4)
