"""The host side of a decode step (generation/engine/paged_batch.py, engine.py): the block table kept
across steps and the inputs built from it in numpy equal what the rows' block lists say, through
joins, forks, finished rows, retractions and chunked prefill; the sampled tokens and logprobs
come back from the device bit for bit in one copy; and the step timer splits steps when asked."""

from __future__ import annotations

import math
import random
from concurrent.futures import Future

import numpy as np
import pytest
import torch
from generation_helpers import VOCAB_SIZE, tiny_config
from transformers import Qwen2ForCausalLM

from areal_flow.generation.engine.decode import DecodeStep, Forward
from areal_flow.generation.engine.generation_engine import GenerationEngine, GenerationRequest, SamplingParams
from areal_flow.generation.engine.kv_batch import Row
from areal_flow.generation.engine.paged import BlockPool, block_table
from areal_flow.generation.engine.paged_batch import PagedBatch
from areal_flow.generation.engine.sampler import Drawn
from areal_flow.generation.engine.step_timing import PARTS, per_step_ms


def _batch(num_blocks: int | None, chunk: int | None) -> PagedBatch:
    torch.manual_seed(0)
    step = DecodeStep.for_model(Qwen2ForCausalLM(tiny_config()).eval())
    kv = BlockPool(layers=len(step.layers), kv_heads=step.kv_heads, head_dim=step.head_dim, block_size=4,
                   num_blocks=num_blocks, dtype=torch.float32, device=torch.device("cpu"))
    return PagedBatch(kv, step, chunk)


def _row(prompt: tuple[int, ...]) -> Row:
    return Row(GenerationRequest(prompt, SamplingParams()), Future(), frozenset())


@pytest.mark.parametrize("num_blocks, chunk", [(None, None), (14, None), (24, 5)])
@torch.inference_mode()
def test_every_forward_gets_the_inputs_the_rows_block_lists_say(num_blocks, chunk):
    batch = _batch(num_blocks, chunk)
    model_forward, checked = batch.model.forward, []

    def checking_forward(step: Forward, pool: BlockPool) -> torch.Tensor:
        # What the inputs were built from before the table was kept: each row's list, every step.
        ready, size = batch.ready, pool.block_size
        assert torch.equal(step.decode_table, block_table([row.blocks for row in ready], pool.device))
        lengths = torch.tensor([row.computed + 1 for row in ready], dtype=torch.int64)
        assert torch.equal(step.decode_lengths, lengths) and step.decode_width == max(lengths.tolist(), default=0)
        decode = step.decode
        assert step.tokens[:decode].tolist() == [row.output_ids[-1] for row in ready]
        assert step.positions[:decode].tolist() == (lengths - 1).tolist()
        slots = [row.blocks[p // size] * size + p % size for row, p in zip(ready, (lengths - 1).tolist())]
        assert step.write[:decode].tolist() == slots
        assert all(t.dtype == torch.int64 for t in (step.tokens, step.positions, step.write, step.logits_at))
        checked.append(decode)
        return model_forward(step, pool)

    batch.model.forward = checking_forward  # the instance's, which PagedBatch.forward calls
    rng = random.Random(0)
    prompts = [tuple(rng.randrange(2, VOCAB_SIZE) for _ in range(rng.randint(1, 9))) for _ in range(6)]
    waiting = [_row(prompts[i % 6]) for i in range(16)]  # some share a prompt: followers that fork
    retracted_any = False
    for _ in range(40):
        if waiting and rng.random() < 0.5:
            batch.add([waiting.pop() for _ in range(min(len(waiting), rng.randint(1, 3)))])
        for row, logits in zip(batch.ready, batch.logits if batch.logits is not None else []):
            row.output_ids.append(int(logits.argmax()))
            if rng.random() < 0.15:
                row.finish = ("length", None)
        batch.drop_finished()
        if not batch.rows:
            continue
        retracted = batch.make_room()
        retracted_any |= bool(retracted)
        for row in retracted:  # queued again: prefilled anew with their tokens so far
            waiting.insert(0, row)
        batch.forward({})
    assert len(checked) > 20 and max(checked) >= 4
    if num_blocks == 14:
        assert retracted_any  # the small pool retracted rows, whose table rows went with them


def test_tokens_and_logprobs_come_back_bit_for_bit_in_one_copy():
    tokens = torch.tensor([0, 5, 2**40, 151935], dtype=torch.int64)
    logprobs = torch.tensor([-0.0, -1e-30, -math.inf, math.nan], dtype=torch.float32)
    got_tokens, got = Drawn.launch([], tokens, logprobs).read()
    assert got_tokens == [0, 5, 2**40, 151935] and got.dtype == np.float32
    assert got.view(np.int32).tolist() == logprobs.view(torch.int32).tolist()  # the bits, -0.0 and NaN too
    lp = torch.randn(300).log_softmax(0)
    assert Drawn.launch([], torch.arange(300), lp).read()[1].tolist() == lp.tolist()


def test_the_step_timer_splits_decode_steps_when_asked_and_is_off_by_default(model_dirs):
    plain = GenerationEngine(model_dirs.a, max_batch_size=4, num_threads=1)
    try:
        assert plain.step_timing() is None
    finally:
        plain.shutdown()
    engine = GenerationEngine(model_dirs.a, max_batch_size=4, num_threads=1, time_steps=True)
    try:
        before = engine.step_timing()
        params = SamplingParams(max_new_tokens=6, ignore_eos=True)
        futures = engine.submit_many([GenerationRequest((2, 3, 4 + i), params) for i in range(3)])
        assert all(len(f.result().output_ids) == 6 for f in futures)
        split = per_step_ms(before, engine.step_timing())
    finally:
        engine.shutdown()
    # One prefill step (not counted), then six that sample: the last with no forward after it.
    assert split["steps"] == 6
    assert all(split[part] >= 0 for part in PARTS) and split["forward"] > 0 and split["sample"] > 0
    assert split["wall"] == pytest.approx(sum(split[part] for part in PARTS), rel=1e-6)
    assert math.isnan(split["device_forward"])  # no CUDA events on the CPU
