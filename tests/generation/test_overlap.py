"""The overlap schedule: each forward is launched before the tokens it feeds are read back (on a GPU
the host's work then hides behind the device's). It must answer what the schedule without overlap
answers: the same tokens, logprobs and finish reasons, bit for bit under batch-invariant decoding
(greedy and seeded), with rows ending on eos, stop ids and length at different steps, rows joining
a running batch, rows retracted from a small pool, prompt and top logprobs."""

from __future__ import annotations

import pytest
from generation_helpers import ModelDirs, torch_threads

from areal_flow.generation.engine.generation_engine import GenerationEngine, GenerationRequest, SamplingParams
from areal_flow.generation.engine.paged_batch import PagedBatch
from areal_flow.generation.engine.sampler import Drawn

PROMPTS = [[2, 7, 3, 9], [5, 6], [3, 4, 5, 6, 7, 8, 9, 10, 11], [12, 2], [4, 4, 4, 4, 4, 4, 4], [9] * 20]


def requests(logprobs: bool = True) -> list[GenerationRequest]:
    """Greedy and seeded rows ending on eos, stop ids or length; two answers of a prompt; one with
    prompt and top logprobs (`logprobs`; those are read on the host when computed)."""
    out = []
    for i in range(18):
        prompt = PROMPTS[i % len(PROMPTS)]
        params = SamplingParams(
            max_new_tokens=3 + 5 * (i % 7), temperature=0.0 if i % 3 == 0 else 1.0, seed=None if i % 3 == 0 else 50 + i,
            stop_token_ids=(4, 11) if i % 4 == 1 else (), top_k=5 if i % 5 == 2 else -1)
        extra = dict(logprob_start_len=1, top_logprobs_num=3) if i == 7 and logprobs else {}
        out.append(GenerationRequest(tuple(prompt), params, rid=f"r{i}", **extra))
    return out


def answers(engine: GenerationEngine, late: bool, retractions: dict[str, int] | None = None,
            logprobs: bool = True) -> dict[str, tuple]:
    """All requests, at once or half of them joining the running batch (`retractions`: each one's, filled in)."""
    retractions = {} if retractions is None else retractions
    batch = requests(logprobs)
    half = len(batch) // 2 if late else len(batch)
    futures = engine.submit_many(batch[:half])
    if late:
        while engine.stats()["generated_tokens"] < 5:
            pass
        futures += engine.submit_many(batch[half:])
    out = {}
    for future in futures:
        r = future.result(timeout=120)
        retractions[r.rid] = r.retractions
        out[r.rid] = (r.output_ids, r.output_logprobs, r.finish_reason, r.matched_stop, r.input_logprobs,
                      r.output_top_logprobs)
    return out


@pytest.mark.parametrize("late", [False, pytest.param(True, marks=pytest.mark.slow)])  # 2-3 s each
@pytest.mark.parametrize("max_total_tokens", [None, 96])
def test_overlapped_steps_answer_bit_for_bit_as_without_overlap(model_dirs: ModelDirs, late, max_total_tokens):
    got, retractions = {}, {True: {}, False: {}}
    with torch_threads(1):
        for overlap in (True, False):
            engine = GenerationEngine(model_dirs.a, max_batch_size=8, batch_invariant=True, num_threads=1,
                                      overlap=overlap, page_size=4, max_total_tokens=max_total_tokens)
            try:
                got[overlap] = answers(engine, late, retractions[overlap])
            finally:
                engine.shutdown()
    assert got[True].keys() == got[False].keys()
    for rid, answer in got[False].items():
        if retractions[True][rid] == retractions[False][rid] == 0:
            assert got[True][rid] == answer, rid
        else:  # prefilled anew at another step: its next logits from a prefill, not a decode step
            tokens, logprobs, *rest = got[True][rid]
            assert (tokens, tuple(rest)) == (answer[0], answer[2:]), rid
            assert logprobs == pytest.approx(answer[1], abs=1e-5)
    reasons = {finish for _, _, finish, _, _, _ in got[True].values()}
    assert {"stop", "length"} <= reasons  # rows ended both ways, at many steps
    assert len({len(tokens) for tokens, *_ in got[True].values()}) > 5
    if max_total_tokens:  # 18 requests of up to 53 tokens in 96 slots: some were retracted and went on
        assert sum(retractions[True].values()) > 0 and sum(retractions[False].values()) > 0


@pytest.mark.slow  # 3.4 s
def test_default_decoding_overlapped_keeps_the_greedy_tokens(model_dirs: ModelDirs):
    """Without batch invariance a row's logits may move in the last bits with the batch (rows that
    ended go through one more forward when overlapped): the greedy tokens stay, the logprobs near."""
    got = {}
    for overlap in (True, False):
        engine = GenerationEngine(model_dirs.a, max_batch_size=8, num_threads=1, overlap=overlap, page_size=4,
                                  chunked_prefill_size=8)
        try:
            got[overlap] = answers(engine, late=True)
        finally:
            engine.shutdown()
    for rid, (tokens, logprobs, finish, *_) in got[False].items():
        if rid in {"r0", "r3", "r6", "r9", "r12", "r15"}:  # greedy
            other = got[True][rid]
            assert other[0] == tokens and other[2] == finish
            assert other[1] == pytest.approx(logprobs, abs=1e-5)


def test_the_forward_is_launched_before_the_tokens_it_feeds_are_read(model_dirs: ModelDirs, monkeypatch):
    """The order of a decode step's calls: with overlap the next forward comes between the
    sampling and the wait for its tokens; without, after the wait."""
    events: list[str] = []
    forward, read = PagedBatch.forward, Drawn.read

    def logged_forward(self, *args, **kwargs):
        events.append("forward")
        return forward(self, *args, **kwargs)

    def logged_read(self):
        events.append("read")
        return read(self)

    monkeypatch.setattr(PagedBatch, "forward", logged_forward)
    monkeypatch.setattr(Drawn, "read", logged_read)
    for overlap in (True, False):
        events.clear()
        engine = GenerationEngine(model_dirs.a, max_batch_size=4, num_threads=1, overlap=overlap)
        try:
            engine.submit([2, 7, 3], max_new_tokens=6, ignore_eos=True, temperature=0.0).result(timeout=60)
        finally:
            engine.shutdown()
        # The prefill's forward, then per token: sampling read and a forward (in one order or the other).
        steps = "".join("f" if e == "forward" else "r" for e in events)
        if overlap:  # the last token's forward runs too, its result dropped
            assert steps == "f" + "fr" * 6
        else:
            assert steps == "f" + "rf" * 5 + "r"


@pytest.mark.gpu
def test_on_cuda_decoding_waits_for_the_device_only_through_the_tokens_read_back(model_dirs: ModelDirs):
    """With CUDA's sync debug mode on "error", any copy or call that waits for the device (and so
    for the forward queued ahead: the overlap lost) fails the step. Only the wait for each step's
    tokens (an event, which the mode does not count) remains. Warmed up first: graphs captured and
    the pool grown once, which do wait."""
    import torch

    engine = GenerationEngine(model_dirs.a, max_batch_size=8, device="cuda", dtype=torch.bfloat16, num_threads=1)
    try:
        answers(engine, late=True, logprobs=False)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = answers(engine, late=True, logprobs=False)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    finally:
        engine.shutdown()
    assert len(got) == 18 and {finish for _, _, finish, *_ in got.values()} <= {"stop", "length"}
