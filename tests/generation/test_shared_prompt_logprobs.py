"""Prompt logprobs (logprob_start_len) of requests that share one prompt while it is prefilled in
chunks: a request that arrives after the shared prefill has passed the first position it needs
logits of must not follow that prefill (those logits are gone), and every request gets exactly the
positions it asked for, equal to a plain transformers forward."""

from __future__ import annotations

import time
from concurrent.futures import Future

import torch
from generation_helpers import ModelDirs, before_every_forward, full_forward_logprobs, load_reference
from test_paged_cache import model_and_batch

from areal_flow.generation.engine.generation_engine import GenerationEngine, GenerationRequest, SamplingParams
from areal_flow.generation.engine.kv_batch import Row

LONG = tuple(2 + (7 * i) % 16 for i in range(40))  # five chunks of 8
SHORT = (2, 7, 3, 9, 4)


@torch.no_grad()
def expected_prompt_logprobs(model: torch.nn.Module, prompt: tuple[int, ...], start: int) -> list[float | None]:
    logprobs = torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0].float(), dim=-1)
    return [None] + [float(logprobs[p - 1, prompt[p]]) for p in range(start + 1, len(prompt))]


def check_prompt_logprobs(got: list[float | None], expected: list[float | None]) -> None:
    assert len(got) == len(expected) and got[0] is None and expected[0] is None
    torch.testing.assert_close(torch.tensor(got[1:]), torch.tensor(expected[1:]), atol=1e-4, rtol=0)


def test_requests_joining_a_chunked_shared_prefill_late_get_the_prompt_logprobs_they_ask_for(model_dirs: ModelDirs):
    """A 40-token prompt prefilled 8 tokens a forward beside two decoding rows; more requests of it
    arrive at its 2nd and 4th chunk, with logprob_start_len before and after what the prefill has
    passed, and none. Each gets its own range of prompt logprobs, all exact; the late ones that need
    passed positions share one second prefill, the others follow the first."""
    engine = GenerationEngine(model_dirs.a, max_batch_size=16, chunked_prefill_size=8, page_size=4)
    chunks = 0
    late: list[tuple[GenerationRequest, Future]] = []

    def request(rid: str, start: int | None, max_new_tokens: int = 3) -> GenerationRequest:
        return GenerationRequest(LONG, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True), rid=rid,
                                 logprob_start_len=start)

    def arrive(*requests: GenerationRequest) -> None:
        late.extend(zip(requests, engine.submit_many(list(requests))))

    def on_forward(module, args) -> None:
        # Runs on the engine's thread before the forward: what it submits is admitted at the next
        # step, when the first prefill has computed 16 (at chunk 2) or 32 (at chunk 4) tokens.
        nonlocal chunks
        if args[0].numel() >= 8:  # a forward with a prompt chunk (the decode rows add 2 tokens)
            chunks += 1
            if chunks == 2:
                # In this order: "after" and "none" can follow the first prefill; "before" cannot,
                # and leads a second, which "score" follows (a row follows the newest it can).
                arrive(request("after", 20), request("none", None), request("before", 5),
                       request("score", 0, max_new_tokens=0))
            elif chunks == 4:
                # The first prefill has passed 26 by then, the second has not begun (it waits for
                # the first's chunks): both follow the second.
                arrive(request("late-before", 26), request("late-after", 36))

    try:
        # Decoding rows, long enough to be decoding beside every chunk even on a slow machine.
        decoding = engine.submit_many([GenerationRequest(SHORT, SamplingParams(max_new_tokens=150, ignore_eos=True))
                                       for _ in range(2)])  # together: one prefill
        while engine.stats()["generated_tokens"] < 4:
            time.sleep(0.001)
        before_every_forward(engine, on_forward)
        first = [request("lead", 30), request("plain", None), request("from-10", 10)]
        futures = list(zip(first, engine.submit_many(first)))
        results = {req.rid: (req, f.result(timeout=60)) for req, f in futures}
        results.update({req.rid: (req, f.result(timeout=60)) for req, f in late})
        decoded = [f.result(timeout=60) for f in decoding]
        stats = engine.stats()
    finally:
        engine.shutdown()

    assert len(results) == 9
    reference = load_reference(model_dirs.a)
    for rid, (req, result) in results.items():
        start = req.logprob_start_len
        if start is None:
            assert result.input_logprobs == [], rid
        else:
            check_prompt_logprobs(result.input_logprobs, expected_prompt_logprobs(reference, LONG, start))
        assert result.completion_tokens == req.params.max_new_tokens
        expected = full_forward_logprobs(reference, list(LONG), result.output_ids, 1.0)
        torch.testing.assert_close(torch.tensor(result.output_logprobs), expected, atol=1e-4, rtol=0)
    for result in decoded:
        expected = full_forward_logprobs(reference, list(SHORT), result.output_ids, 1.0)
        torch.testing.assert_close(torch.tensor(result.output_logprobs), expected, atol=1e-4, rtol=0)
    # The long prompt twice (the second for "before"), the short one once: the requests that could
    # still follow a prefill did.
    assert stats["prefill_tokens"] == len(SHORT) + 2 * len(LONG)
    assert stats["kv_blocks_used"] == 0


@torch.inference_mode()
def test_a_row_that_needs_logits_a_prefill_has_passed_leads_its_own():
    """PagedBatch.add directly: after one chunk of a 12-token prompt (4 computed), rows asking for
    positions from 4 on or for none follow it, a row asking from 2 leads a new prefill, and a row
    asking from 0 follows that one (a row follows the newest prefill it can); each prefill keeps
    the logits its rows need, as a whole forward computes them."""
    reference, batch = model_and_batch(num_blocks=None, chunk=4)
    prompt = tuple(range(2, 14))

    def row(start: int | None) -> Row:
        return Row(GenerationRequest(prompt, SamplingParams(), logprob_start_len=start), Future(), frozenset())

    leader = row(8)
    batch.add([leader])
    batch.make_room()
    batch.forward({id(leader): 4})
    assert leader.computed == 4
    early, at_four, plain, from_zero = row(2), row(4), row(None), row(0)
    batch.add([at_four, plain, early, from_zero])
    assert batch.pending == [leader, early]
    assert batch.followers == {id(leader): [at_four, plain], id(early): [from_zero]}
    assert batch.prefill_progress() == {prompt: 0}
    completed = []  # (prefill, the positions its rows need)
    while batch.pending:
        for ready, logits in zip(batch.ready, batch.logits):  # a completed row decodes along
            ready.output_ids.append(int(logits.argmax()))
        batch.make_room()
        keep = {id(lead): max(r.prompt_positions for r in (lead, *batch.followers.get(id(lead), ())))
                for lead in batch.pending}
        completed += [(done, keep[id(done.leader)]) for done in batch.forward(keep)[2]]
    expected = torch.log_softmax(reference(input_ids=torch.tensor([prompt])).logits[0], dim=-1)
    assert [(done.leader, need) for done, need in completed] == [(leader, 8), (early, 12)]
    for done, need in completed:
        assert len(done.prompt_logits) >= need
        got = torch.log_softmax(done.prompt_logits[-need:], dim=-1)
        torch.testing.assert_close(got, expected[-need:], atol=1e-5, rtol=0)


def test_under_a_kv_budget_a_late_request_that_prefills_its_own_waits_for_room(model_dirs: ModelDirs):
    """12 blocks of 4 hold one 40-token prompt and its answer (11 blocks), not two. A request that
    arrives at its 2nd chunk asking for logprobs from 5 needs its own prefill: admission counts
    that prefill's blocks (not the 2 of a follower), so it waits for the first to finish instead of
    being admitted and retracted midway; a request behind it waits its turn too."""
    engine = GenerationEngine(model_dirs.a, max_batch_size=16, chunked_prefill_size=8, page_size=4,
                              max_total_tokens=48)
    chunks, late = 0, []

    def on_forward(module, args) -> None:
        nonlocal chunks
        if args[0].numel() >= 8:
            chunks += 1
            if chunks == 2:
                late.extend(engine.submit_many([
                    GenerationRequest(LONG, SamplingParams(max_new_tokens=3, ignore_eos=True), rid="before",
                                      logprob_start_len=5),
                    GenerationRequest(LONG, SamplingParams(max_new_tokens=3, ignore_eos=True), rid="after",
                                      logprob_start_len=20)]))

    try:
        before_every_forward(engine, on_forward)
        first = engine.submit_many([GenerationRequest(LONG, SamplingParams(max_new_tokens=3, ignore_eos=True),
                                                      rid="lead", logprob_start_len=30)])
        results = [first[0].result(timeout=60)]  # the late ones arrived during its prefill
        results += [f.result(timeout=60) for f in late]
        stats = engine.stats()
    finally:
        engine.shutdown()
    reference = load_reference(model_dirs.a)
    for start, result in zip((30, 5, 20), results):
        check_prompt_logprobs(result.input_logprobs, expected_prompt_logprobs(reference, LONG, start))
    assert [r.retractions for r in results] == [0, 0, 0]
    # "after" follows the second prefill, which takes the lead's first block (4 tokens: positions
    # from 5 on need logits) from the prefix cache.
    assert (stats["prefill_tokens"], stats["cached_tokens"]) == (2 * len(LONG) - 4, 4)


def test_prefill_only_scoring_from_the_prompt_end_makes_no_token(model_dirs: ModelDirs):
    """max_new_tokens 0 with logprob_start_len at the prompt's end (SGLang allows it): no prompt
    logprob to report and no token to make; the paged engine answered it with one sampled token."""
    engine = GenerationEngine(model_dirs.a, chunked_prefill_size=4)
    prompt = (2, 3, 4, 5, 6, 7)
    try:
        results = [f.result(timeout=60) for f in engine.submit_many([
            GenerationRequest(prompt, SamplingParams(max_new_tokens=0), rid="end", logprob_start_len=len(prompt)),
            GenerationRequest(prompt[:4], SamplingParams(max_new_tokens=0), rid="last", logprob_start_len=3)])]
    finally:
        engine.shutdown()
    assert [(r.output_ids, r.finish_reason, r.input_logprobs) for r in results] == \
        [([], "length", []), ([], "length", [None])]
