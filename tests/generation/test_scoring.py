"""Logprobs of given tokens through the engine's own forward (generation/engine/scoring.py) equal, bit
for bit, those a batch-invariant engine reported while sampling the tokens: whole answers, answers
that went on from a cut (a second request on prompt + tokens so far), and requests scored in waves
and batches of any size."""

from __future__ import annotations

import numpy as np
import pytest
from generation_helpers import ModelDirs, load_reference, torch_threads

from areal_flow.generation.engine.decode import DecodeStep
from areal_flow.generation.engine.generation_engine import GenerationEngine
from areal_flow.generation.engine.scoring import Forced, pool_for, score

PROMPTS = [[2, 7, 3, 9], [5, 6], [3, 4, 5, 6, 7, 8, 9, 10, 11], [12, 2], [4, 4, 4, 4, 4, 4, 4], [6]]


def sampled(path: str, requests: list[tuple[list[int], int]], threads: int, temperature: float = 1.0):
    """(tokens, logprobs) of each (prefix, seed) from a batch-invariant engine, all submitted together."""
    engine = GenerationEngine(path, max_batch_size=32, batch_invariant=True, num_threads=threads)
    try:
        futures = [engine.submit(prefix, seed=seed, max_new_tokens=20, temperature=temperature, ignore_eos=True)
                   for prefix, seed in requests]
        return [(f.result(timeout=60).output_ids, f.result().output_logprobs) for f in futures]
    finally:
        engine.shutdown()


def scorer(path: str, block_size: int = 16):
    step = DecodeStep.for_model(load_reference(path), batch_invariant=True)
    return step, pool_for(step, block_size)


@pytest.mark.parametrize("threads", [1, 2])
def test_scored_logprobs_equal_the_engines_bit_for_bit(model_dirs: ModelDirs, threads):
    requests = [(PROMPTS[i % len(PROMPTS)], 300 + i) for i in range(9)]
    with torch_threads(threads):
        answers = sampled(model_dirs.a, requests, threads)
        step, pool = scorer(model_dirs.a)
        forced = [Forced(prefix, tokens) for (prefix, _), (tokens, _) in zip(requests, answers)]
        together = score(step, pool, forced, 1.0, wave_tokens=10_000)
        waves = score(step, pool, forced, 1.0, wave_tokens=30)  # a request or two a wave
        alone = [score(step, pool, [f], 1.0, wave_tokens=10_000)[0] for f in forced]
    for (_, behav), a, b, c in zip(answers, together, waves, alone):
        expected = np.array(behav, dtype=np.float32)
        assert a.dtype == np.float32 and np.array_equal(a, expected)
        assert np.array_equal(b, expected) and np.array_equal(c, expected)


def test_an_answer_cut_and_continued_scores_as_its_two_requests(model_dirs: ModelDirs):
    """The second request prefilled prompt + the first 7 tokens whole: scored so, it matches; scored
    as one request (those 7 tokens decoded, not prefilled) the keys differ in their last bits."""
    prompt = PROMPTS[2]
    with torch_threads(1):
        (first, first_lp), = sampled(model_dirs.a, [(prompt, 5)], 1)
        cut = first[:7]
        (rest, rest_lp), = sampled(model_dirs.a, [(prompt + cut, 6)], 1)
        step, pool = scorer(model_dirs.a)
        two = score(step, pool, [Forced(prompt, cut), Forced(prompt + cut, rest)], 1.0, wave_tokens=10_000)
    assert np.array_equal(np.concatenate(two), np.array(first_lp[:7] + rest_lp, dtype=np.float32))


def test_temperature_scales_the_logprobs_as_the_sampler_does(model_dirs: ModelDirs):
    requests = [(PROMPTS[0], 11), (PROMPTS[3], 12)]
    with torch_threads(1):
        answers = sampled(model_dirs.a, requests, 1, temperature=0.7)
        step, pool = scorer(model_dirs.a, block_size=4)  # another page size: slots differ, values not
        got = score(step, pool, [Forced(p, t) for (p, _), (t, _) in zip(requests, answers)], 0.7, wave_tokens=100)
    for (_, behav), lp in zip(answers, got):
        assert np.array_equal(lp, np.array(behav, dtype=np.float32))


def test_score_refuses_a_step_that_is_not_batch_invariant_and_empty_requests(model_dirs: ModelDirs):
    step = DecodeStep.for_model(load_reference(model_dirs.a), batch_invariant=False)
    with pytest.raises(ValueError, match="batch-invariant"):
        score(step, pool_for(step, 16), [Forced([2], [3])], 1.0, wave_tokens=100)
    step, pool = scorer(model_dirs.a)
    with pytest.raises(ValueError, match="request 1: a prefix of 2 and 0 tokens"):
        score(step, pool, [Forced([2], [3]), Forced([2, 3], [])], 1.0, wave_tokens=100)
