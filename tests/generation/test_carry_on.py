"""The one loop that carries a cut answer on (generation/client/carry_on.py), for both wires: what it
asks for, how it joins the pieces, and when it stops."""

from __future__ import annotations

import asyncio

from areal_flow.generation.client.carry_on import CUT, Piece, carry_on


def _asker(pieces: list[Piece]):
    asked: list[tuple[list[int], int | None]] = []

    async def ask(so_far: Piece, left: int | None) -> Piece:
        asked.append((list(so_far.token_ids), left))
        return pieces[len(asked) - 1]

    return ask, asked


def test_a_cut_answer_goes_on_with_the_budget_left_and_keeps_each_tokens_version():
    ask, asked = _asker([Piece([3, 4], [-0.3, -0.4], [2, 2], CUT, {"v": "2"}),
                         Piece([5], [-0.5], [3], "stop", {"v": "3"})])
    whole, resumes = asyncio.run(carry_on(Piece([1, 2], [-0.1, -0.2], [1, 1], CUT, {"v": "1"}), 10, ask))
    assert resumes == 2 and asked == [([1, 2], 8), ([1, 2, 3, 4], 6)]
    assert whole == Piece([1, 2, 3, 4, 5], [-0.1, -0.2, -0.3, -0.4, -0.5], [1, 1, 2, 2, 3], "stop", {"v": "3"})


def test_an_answer_that_was_not_cut_is_returned_as_it_is():
    ask, asked = _asker([])
    first = Piece([1], [-0.1], [0], "length")
    assert asyncio.run(carry_on(first, 1, ask)) == (first, 0) and not asked


def test_a_cut_at_the_last_token_of_the_budget_is_a_truncation_without_a_request():
    ask, asked = _asker([])
    whole, resumes = asyncio.run(carry_on(Piece([1, 2], [0.0, 0.0], [0, 0], CUT), 2, ask))
    assert (whole.finish, resumes, asked) == ("length", 0, [])


def test_without_a_budget_the_rest_is_asked_for_without_a_limit():
    ask, asked = _asker([Piece([2], [0.0], [1], "stop")])
    whole, _ = asyncio.run(carry_on(Piece([1], [0.0], [0], CUT), None, ask))
    assert asked == [([1], None)] and whole.token_ids == [1, 2]


def test_the_limit_and_a_closed_rollout_leave_an_answer_cut():
    ask, asked = _asker([Piece([2], [0.0], [1], CUT)] * 5)
    whole, resumes = asyncio.run(carry_on(Piece([1], [0.0], [0], CUT), 100, ask, limit=3))
    assert (whole.finish, resumes, len(whole.token_ids)) == (CUT, 3, 4)
    ask, asked = _asker([Piece([2], [0.0], [1], CUT)] * 5)
    open_calls = iter([True, False])
    whole, resumes = asyncio.run(carry_on(Piece([1], [0.0], [0], CUT), 100, ask, going=lambda: next(open_calls)))
    assert (whole.finish, resumes) == (CUT, 1)
