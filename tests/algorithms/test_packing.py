import random

import pytest

from areal_flow.algorithms.packing import ffd_allocate


def _next_fit(lengths, max_tokens):
    """Naive next-fit over the same decreasing order: the baseline FFD must never lose to."""
    bins, room = 0, -1
    for n in sorted(lengths, reverse=True):
        if bins == 0 or n > room:
            bins, room = bins + 1, max_tokens - n
        else:
            room -= n
    return bins


@pytest.mark.parametrize("seed", range(200))
def test_random_inputs_keep_every_index_once_respect_the_budget_and_min_groups(seed):
    rng = random.Random(seed)
    max_tokens = rng.randint(8, 300)
    lengths = [rng.randint(0, int(max_tokens * 1.3)) for _ in range(rng.randint(0, 40))]
    min_groups = rng.randint(1, 8)
    groups = ffd_allocate(lengths, max_tokens, min_groups=min_groups)

    flat = sorted(i for g in groups for i in g)
    assert flat == list(range(len(lengths)))
    assert len(groups) >= min_groups
    for g in groups:
        total = sum(lengths[i] for i in g)
        # Only a sequence longer than the budget may overflow, and then it is alone.
        assert total <= max_tokens or (len(g) == 1 and lengths[g[0]] > max_tokens)
    assert ffd_allocate(lengths, max_tokens, min_groups=min_groups) == groups  # deterministic
    if lengths:
        assert len(ffd_allocate(lengths, max_tokens)) <= _next_fit(lengths, max_tokens)


def test_packs_tightly_where_next_fit_wastes_room():
    # Decreasing order 6,5,4,3,2 under 10: next-fit closes [6] and [5,4] for good and needs a third
    # bin for 3,2; first-fit puts 4 with 6 and 3,2 with 5: two full bins.
    groups = ffd_allocate([5, 6, 2, 4, 3], max_tokens=10)
    assert len(groups) == 2
    assert sorted(sorted(sum([5, 6, 2, 4, 3][i] for i in g) for g in groups)) == [10, 10]


def test_min_groups_spreads_the_largest_items_and_pads_with_empty_groups():
    assert ffd_allocate([3, 9, 5], max_tokens=100, min_groups=3) == [[1], [2], [0]]
    assert ffd_allocate([4], max_tokens=10, min_groups=3) == [[0], [], []]
    assert ffd_allocate([], max_tokens=10) == [[]]


def test_after_min_groups_items_go_to_the_first_group_they_fit():
    # 8 and 7 open the two required groups; 3 fits only the second, then 2 fits the first.
    assert ffd_allocate([8, 7, 3, 2], max_tokens=10, min_groups=2) == [[0, 3], [1, 2]]


def test_oversize_sequences_get_their_own_group():
    groups = ffd_allocate([50, 3, 4], max_tokens=10)
    assert [0] in groups and len(groups) == 2


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="max_tokens"):
        ffd_allocate([1], max_tokens=0)
    with pytest.raises(ValueError, match="min_groups"):
        ffd_allocate([1], max_tokens=4, min_groups=0)
