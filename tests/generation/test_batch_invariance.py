"""Seeded sampling and batch-invariant decoding (--enable-deterministic-inference): a seeded request
answers with the same tokens and bit-identical logprobs whatever else the engine decodes with it."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from generation_helpers import ModelDirs, generate_ok, running_server, torch_threads, two_prompts_together

from areal_flow.generation.engine.generation_engine import GenerationEngine
from areal_flow.generation.engine.sampling import sample_next_tokens, seeded_uniforms

PROMPTS = [[2, 7, 3, 9], [5, 6], [3, 4, 5, 6, 7, 8, 9, 10, 11], [12, 2], [4, 4, 4, 4, 4, 4, 4]]
SAMPLED = dict(max_new_tokens=24, temperature=1.0, ignore_eos=True)


def answers(engine: GenerationEngine, order: list[int], *, join_late: bool = False) -> dict[int, tuple]:
    """Prompt i with seed 100 + i, submitted in `order`; join_late: the second half once the first
    decodes, so they join a running batch (a cache of another width)."""
    half = len(order) // 2 if join_late else len(order)
    futures = {i: engine.submit(PROMPTS[i % len(PROMPTS)], seed=100 + i, **SAMPLED) for i in order[:half]}
    if join_late:
        while engine.stats()["generated_tokens"] < 3:
            pass
        futures |= {i: engine.submit(PROMPTS[i % len(PROMPTS)], seed=100 + i, **SAMPLED) for i in order[half:]}
    return {i: (f.result(timeout=60).output_ids, f.result().output_logprobs) for i, f in futures.items()}


@pytest.mark.parametrize("threads", [1, 2])
def test_a_seeded_request_answers_bit_identically_alone_and_in_any_batch(model_dirs: ModelDirs, threads):
    with torch_threads(threads):
        engine = GenerationEngine(model_dirs.a, max_batch_size=16, batch_invariant=True, num_threads=threads)
        try:
            alone = {}
            for i in range(10):
                alone |= answers(engine, [i])
            together = answers(engine, list(range(10)))
            late = answers(engine, [9, 3, 7, 1, 5, 0, 8, 2, 6, 4], join_late=True)
        finally:
            engine.shutdown()
    assert together == alone and late == alone  # tokens and logprobs, bit for bit
    assert len({tuple(tokens) for tokens, _ in alone.values()}) == 10


def test_batch_invariant_prompts_of_two_lengths_are_prefilled_together_with_no_padding(model_dirs: ModelDirs):
    """Prompts of 2 and 5 tokens admitted together: one forward of their 7 tokens (the paged cache
    pads nothing, so nothing depends on the other prompt's length)."""
    stats = two_prompts_together(model_dirs.a, batch_invariant=True)
    assert (stats["prefills"], stats["prefill_tokens"], stats["prefill_positions"]) == (1, 7, 7)


def test_the_n_samples_of_a_seeded_request_draw_apart_and_alike_alone_or_batched(model_dirs: ModelDirs):
    body = {"input_ids": PROMPTS[0], "sampling_params": {**SAMPLED, "n": 4, "sampling_seed": 41}, "return_logprob": True}
    with running_server(model_dirs.a, max_batch_size=32, batch_invariant=True) as server:
        assert generate_ok(server, {"input_ids": [2], "sampling_params": {"max_new_tokens": 1}})  # warm
        alone = generate_ok(server, body)
        others: list = []
        threads = [threading.Thread(target=lambda p=p: others.append(generate_ok(server, {
            "input_ids": p, "sampling_params": {**SAMPLED, "n": 3, "sampling_seed": 7}}))) for p in PROMPTS[1:]]
        for t in threads:
            t.start()
        batched = generate_ok(server, body)
        for t in threads:
            t.join()
        single = generate_ok(server, {"input_ids": PROMPTS[0], "sampling_params": {**SAMPLED, "sampling_seed": 43}})
        assert server.engine.stats()["generated_tokens"] > 0
    outputs = [(a["output_ids"], [lp for lp, _, _ in a["meta_info"]["output_token_logprobs"]]) for a in alone]
    assert len({tuple(ids) for ids, _ in outputs}) == 4  # each sample its own stream
    assert [(a["output_ids"], [lp for lp, _, _ in a["meta_info"]["output_token_logprobs"]]) for a in batched] == outputs
    assert single["output_ids"] == alone[2]["output_ids"]  # sample j of seed s is the answer of seed s + j


def test_seeded_rows_sample_their_distribution_and_nothing_outside_it():
    torch.manual_seed(0)
    n = 4000
    logits = torch.randn(1, 12).repeat(n, 1)
    tokens, logprobs = sample_next_tokens(logits, torch.ones(n), torch.ones(n), torch.full((n,), -1),
                                          seeds=list(range(n)), positions=[5] * n)
    probs = torch.softmax(logits[0], dim=-1)
    counts = torch.bincount(tokens, minlength=12).double() / n
    assert (counts - probs).abs().max() < 0.03  # ~4 standard deviations at n = 4000
    torch.testing.assert_close(logprobs, probs.log()[tokens])
    top3 = set(probs.topk(3).indices.tolist())
    cut, _ = sample_next_tokens(logits, torch.ones(n), torch.ones(n), torch.full((n,), 3),
                                seeds=list(range(n)), positions=[5] * n)
    assert set(cut.tolist()) == top3


def test_a_seeded_rows_draw_depends_on_its_seed_and_position_only():
    torch.manual_seed(1)
    logits = torch.randn(6, 12)
    ones, ks = torch.ones(6), torch.full((6,), -1)
    seeds, positions = [3, None, 5, 3, None, 9], [4, 4, 4, 9, 4, 4]
    tokens, _ = sample_next_tokens(logits, ones, ones, ks, torch.Generator().manual_seed(0), seeds=seeds,
                                   positions=positions)
    for row in (0, 2, 3, 5):  # alone, with another generator: the same token
        alone, _ = sample_next_tokens(logits[row:row + 1], ones[:1], ones[:1], ks[:1],
                                      torch.Generator().manual_seed(123), seeds=[seeds[row]], positions=[positions[row]])
        assert alone.item() == tokens[row].item()
    u = seeded_uniforms([3, 3, 4, -1, 2**64 - 1], [4, 5, 4, 0, 0])
    assert len(set(u[:3].tolist())) == 3 and u[3] == u[4]  # a seed counts modulo 2^64
    assert ((0 <= u) & (u <= 1 - 2**-32)).all()
    many = seeded_uniforms(list(range(20000)), [7] * 20000)
    assert abs(many.mean() - 0.5) < 0.01 and abs(np.var(many) - 1 / 12) < 0.005
