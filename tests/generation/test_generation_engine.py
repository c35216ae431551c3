"""The engine without HTTP: sampling, requests joining a running batch, shutdown."""

from __future__ import annotations

import random
import time

import pytest
import torch
from generation_helpers import VOCAB_SIZE, ModelDirs, full_forward_logprobs, load_reference, two_prompts_together

from areal_flow.generation.engine.generation_engine import EngineShutdownError, GenerationEngine
from areal_flow.generation.engine.sampling import sample_next_tokens


def test_sampling_respects_top_k_and_top_p_but_reports_the_full_vocab_logprob():
    torch.manual_seed(0)
    logits = torch.randn(1, 10).repeat(2000, 1)
    temperature = torch.full((2000,), 0.5)
    top_p = torch.cat([torch.ones(1000), torch.full((1000,), 0.5)])
    top_k = torch.cat([torch.full((1000,), 3), torch.full((1000,), -1)])
    tokens, logprobs = sample_next_tokens(logits, temperature, top_p, top_k, torch.Generator().manual_seed(0))
    full = torch.log_softmax(logits[0] / 0.5, dim=-1)
    order = full.argsort(descending=True)
    assert set(tokens[:1000].tolist()) == set(order[:3].tolist())  # top-k 3: all three, nothing else
    nucleus = int((full.exp()[order].cumsum(0) < 0.5).sum()) + 1
    assert set(tokens[1000:].tolist()) <= set(order[:nucleus].tolist())
    torch.testing.assert_close(logprobs, full[tokens])


def test_greedy_rows_take_the_argmax_with_logprob_at_temperature_one():
    logits = torch.randn(3, 7)
    tokens, logprobs = sample_next_tokens(logits, torch.zeros(3), torch.ones(3), torch.full((3,), -1))
    assert tokens.tolist() == logits.argmax(-1).tolist()
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1).max(-1).values)


@pytest.mark.parametrize("max_batch_size, n_requests", [(3, 6), (16, 40)])
def test_requests_joining_a_running_batch_get_exact_logprobs(model_dirs: ModelDirs, max_batch_size, n_requests):
    """Rows join mid-flight (alone or in groups), finish at different steps, decode on as dead rows
    and get compacted away: every logprob must still match a plain forward of its own sequence."""
    engine = GenerationEngine(model_dirs.a, max_batch_size=max_batch_size)  # fewer slots than requests
    reference = load_reference(model_dirs.a)
    rng = random.Random(max_batch_size)
    prompts = [[rng.randrange(2, VOCAB_SIZE) for _ in range(rng.choice([1, 2, 5, 13, 30]))] for _ in range(n_requests)]
    lengths = [rng.choice([1, 3, 8, 20, 60]) for _ in range(n_requests)]
    try:
        futures = []
        for prompt, n in zip(prompts, lengths):
            futures.append(engine.submit(prompt, max_new_tokens=n, temperature=0.8, top_p=0.95, ignore_eos=True))
            time.sleep(rng.choice([0, 0, 0.005]))  # some arrive together, some while others decode
        for prompt, n, future in zip(prompts, lengths, futures):
            result = future.result(timeout=60)
            assert len(result.output_ids) == n and result.finish_reason == "length"
            expected = full_forward_logprobs(reference, prompt, result.output_ids, 0.8)
            torch.testing.assert_close(torch.tensor(result.output_logprobs), expected, atol=1e-4, rtol=0)
    finally:
        engine.shutdown()


def test_compute_counts_split_the_busy_time_into_one_prefill_and_a_decode_step_per_token(model_dirs: ModelDirs):
    """Three answers to one prompt, admitted together: the prompt is prefilled once, then each
    decode step samples for the three rows; prefill and decode seconds make up the busy time."""
    engine = GenerationEngine(model_dirs.a, max_batch_size=8)
    try:
        engine.pause()  # queued while paused, the three join the batch together
        futures = [engine.submit([2, 3, 4, 5], max_new_tokens=10, temperature=0.8, ignore_eos=True) for _ in range(3)]
        engine.continue_generation()
        assert all(len(f.result(timeout=60).output_ids) == 10 for f in futures)
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert (stats["prefills"], stats["prefill_tokens"], stats["prefill_positions"]) == (1, 4, 4)
    assert (stats["decode_steps"], stats["decode_rows"], stats["decode_rows_sq"]) == (10, 30, 90)
    assert stats["decode_row_seconds"] == pytest.approx(3 * stats["decode_seconds"])
    # Step i (from 0) reads the prompt's 4 positions and i + 1 more for each of the 3 rows.
    kvs = [3 * (4 + i + 1) for i in range(10)]
    assert (stats["decode_kv"], stats["decode_kv_sq"], stats["decode_rows_kv"]) == (
        sum(kvs), sum(k * k for k in kvs), sum(3 * k for k in kvs))
    assert stats["decode_kv_seconds"] > 0
    assert stats["prefill_seconds"] > 0 and stats["decode_seconds"] > 0
    assert 0.95 * stats["busy_seconds"] <= stats["prefill_seconds"] + stats["decode_seconds"] <= stats["busy_seconds"]


def test_the_engine_counts_its_waits_for_work_and_the_answers_it_hands_back(model_dirs: ModelDirs):
    """Idle with nothing queued, the thread's time is `waited`; each answer, finished or aborted, is
    counted once in `answered`."""
    started = time.perf_counter()
    engine = GenerationEngine(model_dirs.a, max_batch_size=8)
    try:
        time.sleep(0.3)  # nothing to do: the thread waits
        idle = engine.stats()
        assert idle["waited"] >= 0.25 and idle["answered"] == 0
        futures = [engine.submit([2, 3, 4], max_new_tokens=4, ignore_eos=True) for _ in range(3)]
        assert all(len(f.result(timeout=60).output_ids) == 4 for f in futures)
        engine.pause()  # queued, so the abort finds it whatever the machine's speed
        long = engine.submit([2, 3, 4], max_new_tokens=200, ignore_eos=True, rid="long")
        engine.abort("long")
        assert long.result(timeout=60).finish_reason == "abort"
        engine.continue_generation()
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert stats["answered"] == 4
    # Waiting and computing are apart: together never more than the thread's time.
    assert stats["waited"] + stats["busy_seconds"] <= time.perf_counter() - started


def test_a_prefill_counts_its_tokens_and_a_decode_step_each_rows_own_kv(model_dirs: ModelDirs):
    """Prompts of 2 and 5 tokens prefilled together: 7 positions for 7 tokens (the paged cache pads
    nothing); each decode step reads each row's own context."""
    stats = two_prompts_together(model_dirs.a)
    assert (stats["prefills"], stats["prefill_tokens"], stats["prefill_positions"]) == (1, 7, 7)
    assert stats["prefill_positions_sq"] == 49
    assert stats["prefill_position_seconds"] == pytest.approx(7 * stats["prefill_seconds"])
    assert stats["decode_kv"] == sum((2 + i + 1) + (5 + i + 1) for i in range(3))


def test_the_transformers_path_counts_the_padding_of_its_left_padded_cache(model_dirs: ModelDirs):
    """Without the engine's own forward (fast_decode=False) the prompts are left-padded to 5: 10
    positions computed for 7 tokens; each decode step reads the padded width for both rows."""
    stats = two_prompts_together(model_dirs.a, fast_decode=False)
    assert (stats["prefills"], stats["prefill_tokens"], stats["prefill_positions"]) == (1, 7, 10)
    assert stats["decode_kv"] == sum(2 * (5 + i + 1) for i in range(3))


def test_shutdown_fails_unfinished_requests_and_stops_the_thread(model_dirs: ModelDirs):
    engine = GenerationEngine(model_dirs.a, max_batch_size=1)
    futures = [engine.submit([2, 3], max_new_tokens=250, ignore_eos=True) for _ in range(3)]
    engine.shutdown()
    for future in futures:
        with pytest.raises(EngineShutdownError):
            future.result(timeout=5)
    assert not engine._thread.is_alive()
    with pytest.raises(EngineShutdownError):
        engine.submit([2], max_new_tokens=1)


def test_validation_errors_name_the_field(model_dirs: ModelDirs):
    engine = GenerationEngine(model_dirs.a)
    try:
        for kwargs, field in [({"input_ids": []}, "input_ids"), ({"input_ids": [99]}, "input_ids"),
                              ({"max_new_tokens": -1}, "max_new_tokens"), ({"max_new_tokens": 300}, "context"),
                              ({"temperature": -0.5}, "temperature"), ({"top_p": 1.5}, "top_p"),
                              ({"top_k": -2}, "top_k")]:
            call = {"input_ids": [2, 3], **kwargs}
            with pytest.raises(ValueError, match=field):
                engine.submit(call.pop("input_ids"), **call)
    finally:
        engine.shutdown()
