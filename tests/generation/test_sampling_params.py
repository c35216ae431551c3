"""Sampling parameters beyond temperature/top-p/top-k: min-p, per-request seeds, stop strings, and
ignore_eos winning over stop token ids (SGLang's rules)."""

from __future__ import annotations

import pytest
import torch
from generation_helpers import ModelDirs, greedy_reference, load_reference

from areal_flow.generation.engine.generation_engine import GenerationEngine
from areal_flow.generation.engine.sampling import sample_next_tokens
from areal_flow.generation.http.server import optional_tokenizer

PROMPT = [2, 7, 3, 9]


@pytest.fixture(scope="module")
def engine(model_dirs: ModelDirs) -> GenerationEngine:
    engine = GenerationEngine(model_dirs.a, max_batch_size=8, tokenizer=optional_tokenizer(model_dirs.a))
    yield engine
    engine.shutdown()


def test_min_p_keeps_exactly_the_tokens_at_least_min_p_times_as_likely_as_the_best():
    torch.manual_seed(0)
    logits = torch.randn(1, 12).repeat(3000, 1)
    n = len(logits)
    tokens, logprobs = sample_next_tokens(logits, torch.full((n,), 0.7), torch.ones(n), torch.full((n,), -1),
                                          torch.Generator().manual_seed(0), min_p=torch.full((n,), 0.2))
    probs = torch.softmax(logits[0] / 0.7, dim=-1)
    allowed = set((probs >= 0.2 * probs.max()).nonzero().squeeze(1).tolist())
    assert 1 < len(allowed) < 12  # the cut is a real one
    assert set(tokens.tolist()) == allowed
    torch.testing.assert_close(logprobs, probs.log()[tokens])  # the full-vocabulary logprob


def test_a_seeded_request_repeats_its_tokens_and_another_seed_does_not(engine):
    def run(seed):
        return engine.submit(PROMPT, max_new_tokens=40, temperature=1.0, ignore_eos=True, seed=seed).result(30)

    first, again, other = run(1234), run(1234), run(99)
    assert first.output_ids == again.output_ids and first.output_logprobs == again.output_logprobs
    assert other.output_ids != first.output_ids


def test_a_stop_string_ends_the_output_on_the_token_that_completes_it(engine, model_dirs):
    tokenizer = optional_tokenizer(model_dirs.a)
    free_run = greedy_reference(load_reference(model_dirs.a), PROMPT, 40, stop_ids=())
    # The first pair of consecutive tokens whose text has not appeared before it.
    index = next(i for i in range(2, len(free_run))
                 if tokenizer.decode(free_run[i - 1:i + 1]) not in tokenizer.decode(free_run[:i]))
    stop = tokenizer.decode(free_run[index - 1:index + 1])
    result = engine.submit(PROMPT, max_new_tokens=40, temperature=0, ignore_eos=True, stop=["zz", stop]).result(30)
    assert result.output_ids == free_run[:index + 1]
    assert (result.finish_reason, result.matched_stop) == ("stop", stop)


def test_ignore_eos_also_ignores_stop_token_ids(engine, model_dirs):
    free_run = greedy_reference(load_reference(model_dirs.a), PROMPT, 20, stop_ids=())
    stop_id = free_run[3]
    stopped = engine.submit(PROMPT, max_new_tokens=20, temperature=0, stop_token_ids=[stop_id]).result(30)
    assert stopped.finish_reason == "stop" and stopped.output_ids[-1] == stop_id
    ignored = engine.submit(PROMPT, max_new_tokens=20, temperature=0, stop_token_ids=[stop_id],
                            ignore_eos=True).result(30)
    assert ignored.finish_reason == "length" and ignored.output_ids == free_run


@pytest.mark.parametrize("kwargs, message", [
    ({"min_p": 1.5}, "min_p must be in [0, 1], got 1.5"),
    ({"stop": ["x"] * 33}, "stop must be at most 32 non-empty strings"),
    ({"stop": [""]}, "stop must be at most 32 non-empty strings"),
    ({"seed": 2**64}, "sampling_seed must fit in 64 bits"),
])
def test_bad_sampling_parameters_are_refused_naming_them(engine, kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        engine.submit(PROMPT, **kwargs)


def test_stop_strings_need_a_tokenizer(model_dirs):
    engine = GenerationEngine(model_dirs.a)
    try:
        with pytest.raises(ValueError, match="stop strings need a tokenizer"):
            engine.submit(PROMPT, stop=["a"])
    finally:
        engine.shutdown()
