"""The prefix cache of the paged KV cache (generation/engine/paged.py): full blocks of ended requests kept
under chained digests of their tokens and taken by later requests that start with the same tokens
(a multi-turn rollout's next turn), never across a weight update, and off under deterministic
decoding."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from generation_helpers import full_forward_logprobs, generate_ok, http_call, load_reference, running_server

from areal_flow.generation.engine.generation_engine import GenerationEngine, GenerationRequest, SamplingParams
from areal_flow.generation.engine.paged import BlockPool, OutOfBlocks

TOKENS = [2 + 5 * i % 15 for i in range(28)]  # 28 tokens of the 18-token vocabulary: 7 full blocks of 4


def pool(num_blocks: int | None) -> BlockPool:
    return BlockPool(layers=1, kv_heads=1, head_dim=2, block_size=4, num_blocks=num_blocks, dtype=torch.float32,
                     device=torch.device("cpu"), prefix_cache=True)


def test_a_sequence_takes_the_longest_cached_run_of_its_full_blocks():
    p = pool(16)
    held = p.allocate(4)
    p.register(held, TOKENS[:14], p.epoch)  # 3 full blocks computed, the 4th partly
    assert p.cached_blocks == 3
    p.release(held)
    assert (p.used_blocks, p.free_blocks) == (0, 16)  # idle cached blocks count as free
    assert p.match(TOKENS, most=10) == held[:3]
    assert [p.refs[b] for b in held[:3]] == [1, 1, 1] and p.used_blocks == 3
    assert p.match(TOKENS, most=2) == held[:2]  # a held block is shared
    assert p.refs[held[0]] == 2
    # A name stands for the whole prefix: the same block of tokens after another start is not found.
    assert p.match([99, 98, 97, 96, *TOKENS[4:]], most=10) == []
    assert p.match(TOKENS[:4] + [0] * 8, most=10) == held[:1]


def test_idle_blocks_are_evicted_last_block_first_when_the_free_ones_run_out():
    p = pool(6)
    held = p.allocate(5)
    p.register(held, TOKENS[:20], p.epoch)
    p.release(held)
    other = p.allocate(2)  # the one never-used block, then the deepest idle block
    assert held[4] in other and p.cached_blocks == 4
    assert p.match(TOKENS, most=10) == held[:4]
    p.release(other)
    with_all = p.allocate(2)  # the four matched are held: only the two freed remain
    assert sorted(with_all) == sorted(other)
    with pytest.raises(OutOfBlocks):  # every block is held
        p.allocate(1)


def test_a_growable_pool_grows_rather_than_evict_while_its_cache_is_smaller_than_what_is_held():
    p = pool(None)
    held = p.allocate(p.num_blocks)  # every block
    p.register(held[:8], TOKENS + [0] * 4, p.epoch)
    p.release(held[:8])  # 8 idle, the rest held
    size = p.num_blocks
    p.allocate(1)
    assert p.num_blocks > size and p.cached_blocks == 8  # grew: fewer idle blocks than held ones
    p.release(held[8:])  # one block held now
    size, free = p.num_blocks, p.num_blocks - p.used_blocks - p.cached_blocks
    p.allocate(free + 1)
    assert (p.num_blocks, p.cached_blocks) == (size, 7)  # the idle outnumber the held: one evicted


def test_a_flush_frees_the_idle_blocks_and_keeps_held_ones_out_of_the_cache():
    p = pool(8)
    first, second = p.allocate(2), p.allocate(2)
    p.register(first, TOKENS[:8], p.epoch)
    p.register(second, TOKENS[8:16], p.epoch)
    p.release(first)
    epoch = p.epoch
    p.flush()
    assert p.cached_blocks == 0 and p.match(TOKENS[:8], most=2) == []
    p.release(second)  # held across the flush: freed, not idle
    p.register(second, TOKENS[8:16], epoch)  # keys of the old weights are not taken in
    assert (p.cached_blocks, p.used_blocks, p.free_blocks) == (0, 0, 8)


def run(engine: GenerationEngine, prompt: list[int], params: SamplingParams, **request: object):
    return engine.submit_many([GenerationRequest(tuple(prompt), params, **request)])[0].result(timeout=60)


@contextlib.contextmanager
def engine_of(model_dir: str, **engine_kw: object) -> Iterator[GenerationEngine]:
    engine = GenerationEngine(model_dir, page_size=4, **engine_kw)
    try:
        yield engine
    finally:
        engine.shutdown()


GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.0)


@pytest.mark.parametrize("overlap", [True, False])
def test_a_second_turn_prefills_only_what_the_cache_lacks_and_answers_as_without_it(model_dirs, overlap):
    """A first turn, then a second whose prompt is the first's prompt, answer and an observation."""
    second, stats = {}, {}
    for cache in (True, False):
        with engine_of(model_dirs.a, prefix_cache=cache, overlap=overlap) as engine:
            prompt = TOKENS + run(engine, TOKENS, GREEDY).output_ids + [5, 6, 7, 8, 9]
            second[cache] = run(engine, prompt, GREEDY)
            stats[cache] = engine.stats()
    # The first turn's computed keys: its prompt and its answer, the last token too when overlapped
    # (fed to a forward before it was known to end the answer), else all but it (never fed).
    computed = len(TOKENS) + (12 if overlap else 11)
    assert second[True].cached_tokens == computed // 4 * 4 == stats[True]["cached_tokens"]
    assert second[False].cached_tokens == 0 and stats[False]["cached_tokens"] == 0
    assert stats[True]["prefill_tokens"] == stats[False]["prefill_tokens"] - second[True].cached_tokens
    assert second[True].output_ids == second[False].output_ids
    reference = full_forward_logprobs(load_reference(model_dirs.a), prompt, second[True].output_ids, 1.0)
    for answer in second.values():  # greedy: logprobs at temperature 1
        torch.testing.assert_close(torch.tensor(answer.output_logprobs), reference, atol=1e-4, rtol=0)


def test_new_weights_flush_the_cache(model_dirs):
    with engine_of(model_dirs.a) as engine:
        run(engine, TOKENS, GREEDY)
        assert engine.stats()["kv_blocks_cached"] > 0
        engine.update_weights_from_disk(model_dirs.b, version=1)
        assert engine.stats()["kv_blocks_cached"] == 0
        after = run(engine, TOKENS, GREEDY)
    assert after.cached_tokens == 0
    reference = full_forward_logprobs(load_reference(model_dirs.b), TOKENS, after.output_ids, 1.0)
    torch.testing.assert_close(torch.tensor(after.output_logprobs), reference, atol=1e-4, rtol=0)


def test_prompt_logprobs_are_computed_not_taken_from_the_cache(model_dirs):
    """A request asking for its prompt's logprobs from position 5 takes at most the first block."""
    with engine_of(model_dirs.a) as engine:
        run(engine, TOKENS, GREEDY)
        scored = run(engine, TOKENS, GREEDY, logprob_start_len=5)
    assert scored.cached_tokens == 4 and len(scored.input_logprobs) == len(TOKENS) - 5


def test_deterministic_decoding_keeps_no_prefix_cache_and_the_server_reports_hits_and_flushes(model_dirs):
    with engine_of(model_dirs.a, batch_invariant=True) as engine:
        assert not engine.prefix_cache
    with running_server(model_dirs.a, page_size=4) as server:
        body = {"input_ids": TOKENS, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
        generate_ok(server, body)
        again = generate_ok(server, body)
        assert http_call(server.url, "POST", "/flush_cache")[0] == 200
        flushed = generate_ok(server, body)
    assert again["meta_info"]["cached_tokens"] == 24  # 27 of 28 tokens could come: 6 full blocks
    assert flushed["meta_info"]["cached_tokens"] == 0


def test_requests_sharing_a_prompt_submitted_together_prefill_it_once(model_dirs):
    """The answers of one prompt cut by a weight update come back at once, each with its own tokens
    so far: one computes the prompt's full blocks, the others wait for them and take them from the
    cache (with the cache off, each prefills the whole prompt), and every answer is as alone."""
    tails = [[3, 4], [9, 9, 9, 2, 5], [6], [7, 8, 3]]
    answers, stats = {}, {}
    for cache in (True, False):
        with engine_of(model_dirs.a, prefix_cache=cache) as engine:
            futures = engine.submit_many([GenerationRequest(tuple(TOKENS + tail), GREEDY) for tail in tails])
            answers[cache] = [f.result(timeout=60) for f in futures]
            stats[cache] = engine.stats()
    shared = len(TOKENS) // 4 * 4  # the prompt's full blocks: 7 of 4 tokens
    assert [a.cached_tokens for a in answers[True]] == [0] + [shared] * 3
    assert stats[True]["prefill_tokens"] == stats[False]["prefill_tokens"] - 3 * shared
    reference = load_reference(model_dirs.a)
    for tail, with_cache, without in zip(tails, answers[True], answers[False]):
        assert with_cache.output_ids == without.output_ids
        expected = full_forward_logprobs(reference, TOKENS + tail, with_cache.output_ids, 1.0)
        torch.testing.assert_close(torch.tensor(with_cache.output_logprobs), expected, atol=1e-4, rtol=0)

