"""The engine's memory rules: a KV budget of paged blocks that requests are admitted by and
retracted from, prompts prefilled in chunks beside the decoding rows, and one prefill for
identical prompts (the G answers of a group)."""

from __future__ import annotations

import time

import pytest
import torch
from generation_helpers import ModelDirs, before_every_forward, full_forward_logprobs, greedy_reference, load_reference

from areal_flow.generation.engine.generation_engine import GenerationEngine, GenerationRequest, SamplingParams

PROMPT = (2, 7, 3, 9, 4)


def requests(n: int, prompt: tuple[int, ...] = PROMPT, **params) -> list[GenerationRequest]:
    return [GenerationRequest(prompt, SamplingParams(**params), rid=f"r{i}") for i in range(n)]


@pytest.mark.parametrize("budget, retracted", [(None, False), (2 * (len(PROMPT) + 12) + 3, True)])
def test_requests_beyond_the_kv_budget_are_retracted_and_all_finish_correctly(model_dirs: ModelDirs, budget, retracted):
    """Four answers of 17 tokens each in a pool of 10 blocks of 4 (37 tokens): they are admitted by
    the blocks they need now, and as they grow past the pool the newest are retracted, prefilled
    again later with their tokens so far, and answer as if nothing happened."""
    engine = GenerationEngine(model_dirs.a, max_batch_size=8, max_total_tokens=budget, page_size=4)
    try:
        futures = engine.submit_many(requests(4, max_new_tokens=12, temperature=0.0, ignore_eos=True))
        results = [f.result(timeout=60) for f in futures]
        stats = engine.stats()
    finally:
        engine.shutdown()
    expected = greedy_reference(load_reference(model_dirs.a), list(PROMPT), 12, stop_ids=())
    assert all(r.output_ids == expected for r in results)
    assert (sum(r.retractions for r in results) > 0) == retracted
    assert stats["kv_blocks_total"] == (0 if budget is None else 10)
    assert stats["kv_blocks_used"] == 0  # every block back in the pool


def test_a_long_prompt_is_prefilled_in_chunks_while_the_others_decode(model_dirs: ModelDirs):
    """chunked_prefill_size 4: a 30-token prompt that arrives while short answers decode is
    prefilled over 8 forwards, each of which also decodes the running rows; all logprobs exact."""
    engine = GenerationEngine(model_dirs.a, max_batch_size=8, chunked_prefill_size=4)
    tokens_per_forward: list[int] = []
    before_every_forward(engine, lambda module, args: tokens_per_forward.append(args[0].shape[0]))
    long_prompt = tuple(2 + i % 15 for i in range(30))
    try:
        # Long enough to be still decoding whenever the long prompt comes, on a slow machine too.
        short = engine.submit_many(requests(2, max_new_tokens=150, ignore_eos=True))
        while engine.stats()["generated_tokens"] < 4:
            time.sleep(0.001)
        long = engine.submit(long_prompt, max_new_tokens=5, ignore_eos=True)
        results = [f.result(timeout=60) for f in [*short, long]]
        stats = engine.stats()
    finally:
        engine.shutdown()
    reference = load_reference(model_dirs.a)
    for prompt, result in zip([PROMPT, PROMPT, long_prompt], results):
        expected = full_forward_logprobs(reference, list(prompt), result.output_ids, 1.0)
        torch.testing.assert_close(torch.tensor(result.output_logprobs), expected, atol=1e-4, rtol=0)
    assert max(tokens_per_forward) <= 4 + 2  # a chunk and the two decoding rows
    assert tokens_per_forward.count(4 + 2) >= 7  # the long prompt's chunks, each beside both rows
    assert stats["prefill_tokens"] == len(PROMPT) + len(long_prompt)


def test_the_budget_is_reported_and_a_request_that_can_never_fit_is_refused(model_dirs: ModelDirs):
    engine = GenerationEngine(model_dirs.a, max_total_tokens=40)
    try:
        with pytest.raises(ValueError, match=r"needs 41 tokens of KV cache .* max_total_tokens 40"):
            engine.submit(list(PROMPT), max_new_tokens=36)
        assert engine.stats()["kv_tokens_budget"] == 40
        assert engine.submit(list(PROMPT), max_new_tokens=35, ignore_eos=True).result(timeout=60).completion_tokens == 35
        assert engine.stats()["kv_tokens_reserved"] == engine.stats()["kv_tokens_used"] == 0  # nothing runs now
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="max_total_tokens must be at least 1"):
        GenerationEngine(model_dirs.a, max_total_tokens=0)


def test_identical_prompts_are_prefilled_once_and_sample_independently(model_dirs: ModelDirs):
    engine = GenerationEngine(model_dirs.a, max_batch_size=8)
    other = (5, 6, 2)
    try:
        batch = requests(3, max_new_tokens=20, temperature=1.0, ignore_eos=True) + [
            GenerationRequest(other, SamplingParams(max_new_tokens=20, ignore_eos=True), rid="other")]
        results = [f.result(timeout=60) for f in engine.submit_many(batch)]
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert stats["prefill_tokens"] == len(PROMPT) + len(other)  # each distinct prompt once
    assert len({tuple(r.output_ids) for r in results[:3]}) == 3  # each answer samples its own tokens
    reference = load_reference(model_dirs.a)
    for request, result in zip(batch, results):
        expected = full_forward_logprobs(reference, list(request.input_ids), result.output_ids, 1.0)
        torch.testing.assert_close(torch.tensor(result.output_logprobs), expected, atol=1e-4, rtol=0)
