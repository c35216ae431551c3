"""Helpers over the graph's well-known keys (graph/keys.py)."""


def test_the_final_turn_is_what_follows_the_last_observation():
    from areal_flow.graph.keys import final_turn

    assert final_turn([5, 6, 7, 8, 9], [1, 1, 0, 1, 1]) == [8, 9]
    assert final_turn([5, 6, 7, 8], [1, 0, 0, 1]) == [8]
    assert final_turn([5, 6, 7], [1, 1, 1]) == [5, 6, 7]  # one turn: the whole answer
    assert final_turn([5, 6], [1, 0]) == []  # ended on an observation: no final answer
