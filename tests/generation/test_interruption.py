"""Interrupting the engine between decode steps: abort by rid or all, pause and continue, and a
weight update that aborts the running requests, whose resubmission finishes under the new weights.

The model is slowed by a forward hook (a real sleep in every forward), so that requests are still
decoding when the interruption arrives, whatever the machine's speed.
"""

from __future__ import annotations

import time
from concurrent.futures import Future

import pytest
import torch
from generation_helpers import ModelDirs, before_every_forward, full_forward_logprobs, load_reference, wait_until

from areal_flow.generation.engine.generation_engine import GenerationEngine, GenerationResult

PROMPT = [2, 7, 3, 9]
LONG = 200  # tokens; with the slowed forward a request runs for seconds


@pytest.fixture
def engine(model_dirs: ModelDirs) -> GenerationEngine:
    engine = GenerationEngine(model_dirs.a, max_batch_size=8)
    before_every_forward(engine, lambda *_: time.sleep(0.005))
    yield engine
    engine.shutdown()


def decoding(engine: GenerationEngine, at_least: int) -> None:
    wait_until(lambda: engine.stats()["generated_tokens"] >= at_least, f"{at_least} generated tokens")


def long_request(engine: GenerationEngine, rid: str, prompt: list[int] = PROMPT) -> Future[GenerationResult]:
    return engine.submit(prompt, max_new_tokens=LONG, temperature=0.8, ignore_eos=True, rid=rid)


def assert_exact_logprobs(model_dir: str, prompt: list[int], result: GenerationResult) -> None:
    expected = full_forward_logprobs(load_reference(model_dir), prompt, result.output_ids, 0.8)
    torch.testing.assert_close(torch.tensor(result.output_logprobs), expected, atol=1e-4, rtol=0)


@pytest.mark.slow  # 1.4-2.3 s: the full suite runs it; the fast tier keeps its 3 minutes
def test_abort_by_rid_answers_that_request_with_its_tokens_so_far_and_spares_the_others(engine, model_dirs):
    futures = {rid: long_request(engine, rid, [2 + i, 5]) for i, rid in enumerate("abc")}
    decoding(engine, 3 * 5)
    engine.abort("no-such-rid")  # unknown: nothing happens
    engine.abort("b")
    b = futures["b"].result(timeout=5)
    assert b.finish_reason == "abort" and 0 < len(b.output_ids) < LONG
    assert not futures["a"].done() and not futures["c"].done()
    assert len(b.output_logprobs) == len(b.output_versions) == len(b.output_ids)
    assert_exact_logprobs(model_dirs.a, [3, 5], b)  # the partial output is consistent
    for rid in "ac":
        result = futures[rid].result(timeout=60)
        assert result.finish_reason == "length" and len(result.output_ids) == LONG
    # The aborted rid is free again: SGLang's clients resubmit under the same rid.
    assert engine.submit([3, 5], max_new_tokens=2, rid="b").result(timeout=10).finish_reason == "length"


def test_abort_all_answers_running_and_queued_requests(model_dirs):
    engine = GenerationEngine(model_dirs.a, max_batch_size=1)  # the second request must queue
    before_every_forward(engine, lambda *_: time.sleep(0.005))
    try:
        running, queued = long_request(engine, "r"), long_request(engine, "q")
        decoding(engine, 3)
        engine.abort()
        assert [f.done() for f in (running, queued)] == [True, True]  # answered before abort returns
        r, q = running.result(), queued.result()
        assert r.finish_reason == q.finish_reason == "abort"
        assert len(r.output_ids) > 0 and q.output_ids == []
        assert engine.is_idle()
    finally:
        engine.shutdown()


def test_pause_aborts_the_running_requests_and_holds_new_ones_until_continue(engine):
    first = long_request(engine, "first")
    decoding(engine, 3)
    assert not engine.is_idle()
    engine.pause()
    aborted = first.result(timeout=0)  # answered by the time pause returns
    assert aborted.finish_reason == "abort" and 0 < len(aborted.output_ids) < LONG
    assert engine.stats()["paused"] is True

    held = engine.submit(PROMPT, max_new_tokens=3, rid="held")
    time.sleep(0.3)
    assert not held.done() and engine.stats()["num_waiting_reqs"] == 1
    engine.continue_generation()
    assert held.result(timeout=10).finish_reason == "length"
    assert engine.stats()["paused"] is False


@pytest.mark.slow  # 1.1-1.6 s: the full suite runs it; the fast tier keeps its 3 minutes
def test_an_update_that_aborts_resumes_under_the_new_weights_with_stitched_versions(engine, model_dirs):
    future = long_request(engine, "r")
    decoding(engine, 10)
    started = time.perf_counter()
    engine.update_weights_from_disk(model_dirs.b, 1, abort_all_requests=True)
    waited = time.perf_counter() - started
    first = future.result(timeout=0)  # aborted before the update returned
    k = len(first.output_ids)
    assert first.finish_reason == "abort" and 0 < k < LONG and set(first.output_versions) == {0}
    # It did not wait for the request to finish: about one decode step, not the ~1 s that remained.
    assert waited < 0.5, waited

    # The client's resubmission: prompt + tokens so far, the remaining budget, the same rid.
    second = engine.submit(PROMPT + first.output_ids, max_new_tokens=LONG - k, temperature=0.8, ignore_eos=True,
                           rid="r").result(timeout=60)
    assert second.finish_reason == "length" and set(second.output_versions) == {1}
    tokens = first.output_ids + second.output_ids
    assert len(tokens) == LONG
    # Each token's logprob is that of the weights that produced it, on the whole sequence before it.
    under_a = full_forward_logprobs(load_reference(model_dirs.a), PROMPT, tokens, 0.8)
    under_b = full_forward_logprobs(load_reference(model_dirs.b), PROMPT, tokens, 0.8)
    stitched = torch.tensor(first.output_logprobs + second.output_logprobs)
    torch.testing.assert_close(stitched, torch.cat([under_a[:k], under_b[k:]]), atol=1e-4, rtol=0)
    assert (under_a[k:] - under_b[k:]).abs().max() > 1e-2  # the two models really differ there


def test_an_update_without_abort_waits_for_the_running_requests(engine, model_dirs):
    future = engine.submit(PROMPT, max_new_tokens=40, temperature=0.8, ignore_eos=True)
    decoding(engine, 3)
    engine.update_weights_from_disk(model_dirs.b, 1)
    result = future.result(timeout=0)  # it finished before the update went in
    assert result.finish_reason == "length" and set(result.output_versions) == {0}
    assert engine.version == 1


def test_the_time_spent_loading_weights_is_counted_apart_from_generating(engine, model_dirs):
    engine.submit(PROMPT, max_new_tokens=20, temperature=0.8, ignore_eos=True).result(timeout=60)
    before = engine.stats()
    assert before["busy_seconds"] > 0 and before["load_seconds"] == 0
    engine.update_weights_from_disk(model_dirs.b, 1)
    after = engine.stats()
    assert after["load_seconds"] > 0
    assert after["busy_seconds"] == before["busy_seconds"]  # a load is not generating


@pytest.mark.slow  # 1.1-1.6 s: the full suite runs it; the fast tier keeps its 3 minutes
def test_a_retracting_pause_resumes_the_requests_under_the_new_weights_in_one_answer(engine, model_dirs):
    future = long_request(engine, "r")
    decoding(engine, 10)
    engine.pause(mode="retract")
    stats = engine.stats()
    assert not future.done() and stats["num_waiting_reqs"] == 1 and stats["num_running_reqs"] == 0  # requeued
    engine.update_weights_from_disk(model_dirs.b, 1)  # nothing runs: loads at once
    engine.continue_generation()
    result = future.result(timeout=60)
    assert result.finish_reason == "length" and len(result.output_ids) == LONG and result.retractions == 1
    k = result.output_versions.index(1)
    assert k >= 10 and set(result.output_versions[:k]) == {0} and set(result.output_versions[k:]) == {1}
    # Tokens before the pause were sampled from weights a, the rest from b, each on its whole prefix.
    under_a = full_forward_logprobs(load_reference(model_dirs.a), PROMPT, result.output_ids, 0.8)
    under_b = full_forward_logprobs(load_reference(model_dirs.b), PROMPT, result.output_ids, 0.8)
    torch.testing.assert_close(torch.tensor(result.output_logprobs), torch.cat([under_a[:k], under_b[k:]]),
                               atol=1e-4, rtol=0)


@pytest.mark.slow  # 1.4-2.3 s: the full suite runs it; the fast tier keeps its 3 minutes
def test_an_in_place_pause_holds_the_requests_with_their_cache_and_they_go_on_under_the_new_weights(
        engine, model_dirs):
    future = long_request(engine, "r")
    decoding(engine, 10)
    engine.pause(mode="in_place")
    held = engine.stats()
    time.sleep(0.2)
    stats = engine.stats()
    assert not future.done() and stats["num_running_reqs"] == 1  # held, not answered or requeued
    assert stats["generated_tokens"] == held["generated_tokens"]  # and not stepped while paused
    engine.update_weights_from_disk(model_dirs.b, 1)  # paused: loads at once under the held batch
    assert engine.version == 1 and not future.done()
    engine.continue_generation()
    result = future.result(timeout=60)
    assert result.finish_reason == "length" and len(result.output_ids) == LONG and result.retractions == 0
    k = result.output_versions.index(1)
    assert k >= 10 and set(result.output_versions[:k]) == {0} and set(result.output_versions[k:]) == {1}
    # The tail was sampled by weights b on top of the KV cache weights a made of the prefix
    # (nothing recomputed): the logprobs say so, and differ from b's over the whole sequence.
    a, b = load_reference(model_dirs.a), load_reference(model_dirs.b)
    ids = PROMPT + result.output_ids
    with torch.no_grad():
        cache = a(input_ids=torch.tensor([ids[:len(PROMPT) + k - 1]]), use_cache=True).past_key_values
        tail = b(input_ids=torch.tensor([ids[len(PROMPT) + k - 1:-1]]), past_key_values=cache).logits[0]
    tail = torch.log_softmax(tail.float() / 0.8, -1).gather(1, torch.tensor(result.output_ids[k:])[:, None])[:, 0]
    under_a = full_forward_logprobs(a, PROMPT, result.output_ids, 0.8)
    expected = torch.cat([under_a[:k], tail])
    torch.testing.assert_close(torch.tensor(result.output_logprobs), expected, atol=1e-4, rtol=0)
    under_b = full_forward_logprobs(b, PROMPT, result.output_ids, 0.8)
    assert (torch.tensor(result.output_logprobs[k:]) - under_b[k:]).abs().max() > 1e-3


def test_a_retracted_seeded_request_draws_the_tokens_it_would_have_drawn(engine):
    def seeded() -> Future[GenerationResult]:
        return engine.submit(PROMPT, max_new_tokens=60, temperature=1.0, ignore_eos=True, seed=7)

    plain = seeded().result(timeout=60)
    future = seeded()
    decoding(engine, 60 + 5)
    engine.pause(mode="retract")
    engine.pause(mode="retract")  # a second pause retracts nothing more
    engine.continue_generation()
    resumed = future.result(timeout=60)
    assert resumed.retractions == 1 and resumed.output_ids == plain.output_ids
    torch.testing.assert_close(resumed.output_logprobs, plain.output_logprobs, atol=1e-5, rtol=0)


def test_an_unknown_pause_mode_is_refused(engine):
    with pytest.raises(ValueError, match="pause mode must be one of"):
        engine.pause(mode="sideways")
    assert not engine.paused
