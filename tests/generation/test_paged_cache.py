"""The paged KV cache (generation/engine/paged.py) and the rows over it (generation/engine/paged_batch.py): block
reference counts, copy-on-write forks, a pool that grows or refuses, retraction when blocks run out,
and a leader whose followers inherit its prefill when it is aborted."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch
from generation_helpers import VOCAB_SIZE, tiny_config
from transformers import Qwen2ForCausalLM

from areal_flow.generation.engine.decode import DecodeStep
from areal_flow.generation.engine.generation_engine import GenerationRequest, SamplingParams
from areal_flow.generation.engine.kv_batch import Row
from areal_flow.generation.engine.paged import BlockPool, OutOfBlocks, block_table, slots
from areal_flow.generation.engine.paged_batch import PagedBatch


def pool(num_blocks: int | None, block_size: int = 4) -> BlockPool:
    return BlockPool(layers=2, kv_heads=2, head_dim=3, block_size=block_size, num_blocks=num_blocks,
                     dtype=torch.float32, device=torch.device("cpu"))


def test_blocks_are_counted_and_come_back_when_nobody_holds_them():
    p = pool(5)
    a = p.allocate(3)
    assert 0 not in a and p.used_blocks == 3 and p.free_blocks == 2
    p.share(a[:2])
    p.release(a)
    assert p.used_blocks == 2  # the two shared blocks are still held once
    p.release(a[:2])
    assert p.used_blocks == 0 and p.free_blocks == 5
    with pytest.raises(OutOfBlocks, match="6 KV blocks asked for, 5 free of 5"):
        p.allocate(6)
    assert p.used_blocks == 0  # a refused allocation takes nothing


def test_a_fork_shares_the_full_blocks_and_copies_the_partly_filled_one():
    p = pool(8)
    blocks = p.allocate(3)  # 10 tokens in blocks of 4: two full, one holding 2
    for k in p.k:
        k.normal_()
    fork = p.fork(blocks, 10)
    assert fork[:2] == blocks[:2] and fork[2] not in blocks
    assert [p.refs[b] for b in blocks] == [2, 2, 1]
    for k in p.k:  # the copy holds what the original block held
        torch.testing.assert_close(k[:, p.slots_of(fork[2])], k[:, p.slots_of(blocks[2])], atol=0, rtol=0)
    assert p.fork(blocks[:2], 8) == blocks[:2]  # nothing partly filled: nothing copied
    assert p.used_blocks == 4


def test_a_pool_without_a_budget_grows_and_keeps_what_it_holds():
    p = pool(None, block_size=2)
    held = p.allocate(10)
    p.k[0][:, p.slots_of(held[0])] = 7.0
    more = p.allocate(100)
    assert len(set(held + more)) == 110 and 0 not in more
    assert p.num_blocks >= 110 and bool((p.k[0][:, p.slots_of(held[0])] == 7.0).all())


def test_slots_follow_the_block_table():
    table = block_table([[3, 1], [2]], torch.device("cpu"))
    assert table.tolist() == [[3, 1], [2, 0]]  # padded with the null block
    assert slots(table, 6, 4).tolist() == [[12, 13, 14, 15, 4, 5], [8, 9, 10, 11, 0, 1]]


def rows(*prompts: tuple[int, ...]) -> list[Row]:
    return [Row(GenerationRequest(p, SamplingParams()), Future(), frozenset()) for p in prompts]


def model_and_batch(num_blocks: int | None, chunk: int | None = None,
                    prefix_cache: bool = False) -> tuple[torch.nn.Module, PagedBatch]:
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(tiny_config(hidden_size=32, intermediate_size=64)).eval()
    reference = Qwen2ForCausalLM(tiny_config(hidden_size=32, intermediate_size=64)).eval()
    reference.load_state_dict(model.state_dict())
    step = DecodeStep.for_model(model)
    kv = BlockPool(layers=len(step.layers), kv_heads=step.kv_heads, head_dim=step.head_dim, block_size=4,
                   num_blocks=num_blocks, dtype=torch.float32, device=torch.device("cpu"), prefix_cache=prefix_cache)
    return reference, PagedBatch(kv, step, chunk)


@torch.inference_mode()
def test_when_blocks_run_out_the_newest_rows_are_retracted_and_the_oldest_goes_on():
    _, batch = model_and_batch(num_blocks=6)
    first, second, third = rows((2, 3, 4, 5, 6), (7, 8, 9), (4, 4, 4, 4, 4, 4, 4))
    batch.add([first, second, third])
    assert batch.make_room() == [] and batch.forward({})[1] == 15  # 2 + 1 + 2 blocks
    retracted = []
    for _ in range(4):  # each row grows by a token a step; at the second, the pool runs out
        for row, logits in zip(batch.ready, batch.logits):
            row.output_ids.append(int(logits.argmax()))
        retracted += batch.make_room()
        batch.forward({})
    # 6 + 4 + 8 tokens fit in 2 + 1 + 2 blocks; 7 + 5 + 9 need 2 + 2 + 3: the newest row goes.
    assert retracted == [third] and third.blocks == [] and third.computed == 0
    assert batch.ready == [first, second]
    assert batch.pool.used_blocks == sum(len(row.blocks) for row in batch.ready) == 5


@torch.inference_mode()
def test_an_aborted_leader_hands_its_prefill_to_a_follower():
    reference, batch = model_and_batch(num_blocks=None, chunk=4)
    prompt = tuple(range(2, 12))
    leader, follower, other = rows(prompt, prompt, prompt)
    batch.add([leader, follower, other])
    batch.make_room()
    batch.forward({})  # the first 4 of 10 tokens
    leader.finish = ("abort", None)
    batch.drop_finished()
    assert batch.pending == [follower] and follower.computed == 4 and leader.blocks == []
    while batch.pending:
        batch.make_room()
        batch.forward({})
    assert batch.ready == [follower, other]
    expected = reference(input_ids=torch.tensor([prompt])).logits[0, -1]
    for logits in batch.logits:
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)
    assert batch.pool.used_blocks == 4  # two shared full blocks, and a last block each
    assert max(prompt) < VOCAB_SIZE


@pytest.mark.parametrize("leader_aborted", [False, True])
@torch.inference_mode()
def test_a_row_sharing_a_pending_prefills_blocks_waits_for_them_and_takes_them_from_the_cache(leader_aborted):
    reference, batch = model_and_batch(num_blocks=None, chunk=4, prefix_cache=True)
    prompt = tuple(range(2, 12))  # 10 tokens: with one more each, two full blocks shared
    leader, waiting = rows((*prompt, 12), (*prompt, 13))
    batch.add([leader, waiting])
    assert batch.pending == [leader] and batch.waiting == {id(leader): [waiting]}
    batch.make_room()
    batch.forward({})  # the leader's first block: not yet both
    assert batch.waiting and waiting.computed == 0
    if leader_aborted:  # it goes on from what the leader computed (its first block, cached when freed)
        leader.finish = ("abort", None)
        batch.drop_finished()
        assert batch.pending == [waiting] and not batch.waiting and waiting.computed == waiting.cached_tokens == 4
    else:
        batch.make_room()
        batch.forward({})  # both blocks computed: the waiting row takes them
        assert batch.pending == [leader, waiting] and waiting.computed == waiting.cached_tokens == 8
        assert waiting.blocks[:2] == leader.blocks[:2]
    while batch.pending:
        for row, logits in zip(batch.ready, batch.logits):  # a ready row feeds what it sampled
            row.output_ids.append(int(logits.argmax()))
        batch.make_room()
        batch.forward({})
    assert batch.ready[-1] is waiting and not batch.waiting
    expected = reference(input_ids=torch.tensor([(*prompt, 13)])).logits[0, -1]
    torch.testing.assert_close(batch.logits[-1], expected, atol=1e-5, rtol=0)


def test_the_cache_memory_is_given_back_and_taken_again_as_new_storage():
    p = pool(4)
    held, storage = p.allocate(2), p.storage
    p.free_memory()  # a colocated trainer's turn: nothing is held any more
    assert p.k == [] and p.used_blocks == 0 and held
    p.ensure()
    assert len(p.k) == 2 and p.k[0].shape == (2, 5 * 4, 3) and p.storage == storage + 1
    p.ensure()
    assert p.storage == storage + 1  # already there: nothing reallocated
