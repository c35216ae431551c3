"""The engine's scheduler as pure code: which queued rows join the batch (in order, within the
room and the KV cache the backend has left), which rows an abort hits, and how retracted rows go
back in line; no thread, lock or model."""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future

import pytest

from areal_flow.generation.engine.commands import Abort
from areal_flow.generation.engine.kv_batch import Row
from areal_flow.generation.engine.requests import GenerationRequest
from areal_flow.generation.engine.sampling import SamplingParams
from areal_flow.generation.engine.scheduler import BlockCapacity, TokenCapacity, admit, claim, requeue, take_aborted


def row(rid: str, prompt: tuple[int, ...] = (1, 2, 3), max_new_tokens: int = 5, **request: object) -> Row:
    return Row(GenerationRequest(prompt, SamplingParams(max_new_tokens=max_new_tokens), rid=rid, **request),
               Future(), frozenset())


def rids(rows: list[Row] | deque[Row]) -> list[str]:
    return [r.request.rid for r in rows]


def test_rows_join_in_order_up_to_the_room_and_their_futures_run():
    waiting = deque(row(f"r{i}") for i in range(5))
    admitted, cancelled = admit(waiting, 3, TokenCapacity.of(None, []))
    assert rids(admitted) == ["r0", "r1", "r2"] and cancelled == []
    assert rids(waiting) == ["r3", "r4"]
    assert all(r.future.running() for r in admitted) and not waiting[0].future.running()


def test_the_first_row_that_does_not_fit_stops_the_queue_even_if_a_later_one_would():
    # Each reserves prompt + max_new_tokens: 3 + 5 = 8 tokens; the long one 3 + 20.
    waiting = deque([row("a"), row("long", max_new_tokens=20), row("b")])
    admitted, _ = admit(waiting, 10, TokenCapacity.of(30, []))
    assert rids(admitted) == ["a"]  # 8 + 23 > 30: "long" waits, and "b" (which fits) waits behind it
    assert rids(waiting) == ["long", "b"]


def test_the_token_budget_counts_what_the_running_rows_reserve():
    assert TokenCapacity.of(None, [row("x")]).free == float("inf")
    assert TokenCapacity.of(20, [row("x"), row("y", max_new_tokens=1)]).free == 20 - 8 - 4
    waiting = deque([row("a"), row("b")])
    admitted, _ = admit(waiting, 10, TokenCapacity.of(20, [row("x")]))
    assert rids(admitted) == ["a"]  # 12 left: one more of 8


def test_cancelled_rows_are_taken_off_without_counting_against_room_or_budget():
    waiting = deque([row("gone"), row("a"), row("b")])
    waiting[0].future.cancel()
    admitted, cancelled = admit(waiting, 2, TokenCapacity.of(16, []))
    assert rids(cancelled) == ["gone"] and rids(admitted) == ["a", "b"] and not waiting


def test_a_retracted_row_is_claimed_again_without_touching_its_running_future():
    r = row("r")
    assert claim(r) and r.future.running()
    assert claim(r)  # running already: a retracted row that goes back in


def test_a_new_sequence_needs_its_blocks_and_one_for_its_next_token_and_a_second_identical_row_forks():
    capacity = BlockCapacity(free=100, block_size=4)
    leader, follower = row("a", prompt=(1, 2, 3, 4, 5)), row("b", prompt=(1, 2, 3, 4, 5))
    assert capacity.fits(leader)
    capacity.take(leader)
    assert capacity.free == 100 - (2 + 1)  # 6 tokens (prompt and its next) in blocks of 4, and one spare
    capacity.take(follower)
    assert capacity.free == 97 - 2  # forks the leader's prefill: a copy of its last block, and one spare


def test_a_row_that_wants_logprobs_of_a_position_the_prefill_passed_leads_a_prefill_of_its_own():
    sequence = tuple(range(1, 11))
    # The batch's prefill of `sequence` has computed 8 of its 10 tokens.
    capacity = BlockCapacity(free=100, block_size=4, prefilling={sequence}, progress={sequence: 8})
    plain = row("plain", prompt=sequence)
    scored = row("scored", prompt=sequence, logprob_start_len=2)  # needs logits from position 2 on
    capacity.take(plain)
    assert capacity.free == 98  # follows
    capacity.take(scored)
    assert capacity.free == 98 - (3 + 1)  # its own prefill: 11 tokens in 3 blocks, and one spare
    assert capacity.progress[sequence] == 0  # a prefill from the start, which any later row can follow


def test_blocks_refuse_a_row_when_too_few_are_free():
    capacity = BlockCapacity(free=3, block_size=4)
    waiting = deque([row("a", prompt=(1,) * 8), row("b", prompt=(2,))])
    admitted, _ = admit(waiting, 8, capacity)
    assert admitted == [] and rids(waiting) == ["a", "b"]  # "a" needs 3 + 1


def test_an_abort_by_rid_marks_the_running_row_and_takes_the_queued_one_off():
    running, waiting = [row("a"), row("b")], deque([row("c"), row("a2")])
    hit, cancelled = take_aborted([Abort("b", queued_too=True), Abort("c", queued_too=True)], running, waiting)
    assert rids(hit) == ["b", "c"] and cancelled == []
    assert [r.finish for r in running] == [None, ("abort", None)]
    assert hit[1].finish == ("abort", None) and rids(waiting) == ["a2"]


def test_a_pause_aborts_only_the_running_rows_and_in_place_touches_none():
    running, waiting = [row("a"), row("b")], deque([row("c")])
    hit, _ = take_aborted([Abort(None, queued_too=False, in_place=True)], running, waiting)
    assert hit == [] and all(r.finish is None for r in running)
    hit, _ = take_aborted([Abort(None, queued_too=False)], running, waiting)
    assert rids(hit) == ["a", "b"] and rids(waiting) == ["c"] and waiting[0].finish is None


def test_an_abort_of_a_cancelled_queued_row_reports_it_to_free_its_rid():
    waiting = deque([row("c")])
    waiting[0].future.cancel()
    hit, cancelled = take_aborted([Abort(None, queued_too=True)], [], waiting)
    assert hit == [] and rids(cancelled) == ["c"] and not waiting


def test_retracted_rows_go_back_first_in_line_in_order_and_count_it():
    waiting = deque([row("q")])
    retracted = [row("a"), row("b")]
    requeue(waiting, retracted)
    assert rids(waiting) == ["a", "b", "q"]
    assert [r.retractions for r in waiting] == [1, 1, 0]


@pytest.mark.parametrize("room", [0, 1])
def test_no_room_admits_nothing_and_one_admits_the_head(room: int):
    waiting = deque([row("a"), row("b")])
    admitted, _ = admit(waiting, room, TokenCapacity.of(None, []))
    assert rids(admitted) == ["a"][:room]
