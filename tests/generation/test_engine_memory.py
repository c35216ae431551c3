"""The engine's memory rules: a KV token budget that makes requests wait rather than overflow,
and one prefill for identical prompts (the G answers of a group)."""

from __future__ import annotations

import pytest
import torch
from generation_helpers import ModelDirs, before_every_forward, full_forward_logprobs, greedy_reference, load_reference

from areal_flow.generation.engine import GenerationEngine, GenerationRequest, SamplingParams

PROMPT = (2, 7, 3, 9, 4)


def rows_per_forward(engine: GenerationEngine) -> list[tuple[int, int]]:
    """(rows, columns) of every input the model sees from now on."""
    shapes: list[tuple[int, int]] = []
    before_every_forward(engine, lambda module, args: shapes.append(tuple(args[0].shape)))
    return shapes


def requests(n: int, prompt: tuple[int, ...] = PROMPT, **params) -> list[GenerationRequest]:
    return [GenerationRequest(prompt, SamplingParams(**params), rid=f"r{i}") for i in range(n)]


@pytest.mark.parametrize("budget, most_rows", [(None, 4), (2 * (len(PROMPT) + 12) + 3, 2)])
def test_requests_beyond_the_kv_budget_wait_and_all_finish_correctly(model_dirs: ModelDirs, budget, most_rows):
    engine = GenerationEngine(model_dirs.a, max_batch_size=8, max_total_tokens=budget)
    try:
        shapes = rows_per_forward(engine)
        futures = engine.submit_many(requests(4, max_new_tokens=12, temperature=0.0, ignore_eos=True))
        results = [f.result(timeout=60) for f in futures]
    finally:
        engine.shutdown()
    expected = greedy_reference(load_reference(model_dirs.a), list(PROMPT), 12, stop_ids=())
    assert all(r.output_ids == expected for r in results)
    # Identical prompts share one prefill row, so decode forwards show how many ran together.
    assert max(rows for rows, columns in shapes if columns == 1) == most_rows


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
        shapes = rows_per_forward(engine)
        batch = requests(3, max_new_tokens=20, temperature=1.0, ignore_eos=True) + [
            GenerationRequest(other, SamplingParams(max_new_tokens=20, ignore_eos=True), rid="other")]
        results = [f.result(timeout=60) for f in engine.submit_many(batch)]
    finally:
        engine.shutdown()
    assert shapes[0] == (2, len(PROMPT))  # one prefill row per distinct prompt
    assert len({tuple(r.output_ids) for r in results[:3]}) == 3  # each answer samples its own tokens
    reference = load_reference(model_dirs.a)
    for request, result in zip(batch, results):
        expected = full_forward_logprobs(reference, list(request.input_ids), result.output_ids, 1.0)
        torch.testing.assert_close(torch.tensor(result.output_logprobs), expected, atol=1e-4, rtol=0)
