import random

import pytest

from areal_flow.controller.trainer_pool import balance, merge_results, plan_step
from areal_flow.transport.messages import RunStep, StepDone


def loads(where: dict[int, tuple[int, int]], assign: dict[int, int], n_ranks: int) -> list[int]:
    load = [0] * n_ranks
    for g, rank in assign.items():
        load[rank] += where[g][1]
    return load


def held(where: dict[int, tuple[int, int]]) -> dict[int, int]:
    return {g: rank for g, (rank, _) in where.items()}


def moved(where, assign) -> int:
    return sum(assign[g] != where[g][0] for g in assign)


def check_plans(where, plans: list[RunStep], n_ranks: int, step: int) -> dict[int, int]:
    """Every group is trained by exactly one rank; a moved group is in its holder's moves, pointing
    at the rank whose `groups` has it; no rank lists a move for a group it does not hold."""
    assert len(plans) == n_ranks and all(p.step == step for p in plans)
    trained = [g for p in plans for g in p.groups]
    assert sorted(trained) == sorted(where)
    assign = {g: r for r, p in enumerate(plans) for g in p.groups}
    for r, p in enumerate(plans):
        for g, to in p.moves.items():
            assert where[g][0] == r, f"rank {r} lists a move of group {g} it does not hold"
            assert to != r and g in plans[to].groups
    expected_moves = {g for g in where if assign[g] != where[g][0]}
    assert {g for p in plans for g in p.moves} == expected_moves
    return assign


# ---- balance --------------------------------------------------------------------------------

def test_balanced_input_moves_nothing():
    where = {0: (0, 30), 1: (0, 10), 2: (1, 25), 3: (1, 15)}  # 40 / 40
    assert balance(where, 2) == held(where)


def test_input_no_single_move_can_improve_moves_nothing():
    where = {0: (0, 100), 1: (1, 1)}  # moving the 100 would only swap which rank is overloaded
    assert balance(where, 2) == held(where)
    where = {0: (0, 12), 1: (1, 10), 2: (2, 11)}
    assert balance(where, 3) == held(where)


def test_one_rank_gets_everything():
    where = {0: (0, 3), 1: (0, 7), 2: (0, 100)}
    assert balance(where, 1) == {0: 0, 1: 0, 2: 0}
    plans = plan_step(4, where, 1)
    assert plans == [RunStep(step=4, groups=[0, 1, 2], moves={})]


def test_everything_on_one_rank_is_spread_over_all_ranks():
    where = {g: (0, 10) for g in range(6)}
    assign = balance(where, 3)
    assert loads(where, assign, 3) == [20, 20, 20]
    assert moved(where, assign) == 4


def test_the_fewest_groups_move_on_a_hand_made_case():
    # Rank 0 holds 1+1+1+1+8 = 12 tokens. The best two-rank split is 8 vs 4; it needs one move
    # (the 8-token group), not four (the 1-token groups).
    where = {0: (0, 1), 1: (0, 1), 2: (0, 1), 3: (0, 1), 4: (0, 8)}
    assign = balance(where, 2)
    assert assign == {0: 0, 1: 0, 2: 0, 3: 0, 4: 1}
    assert moved(where, assign) == 1


def test_groups_already_on_the_light_rank_stay_there():
    where = {0: (0, 10), 1: (0, 10), 2: (0, 10), 3: (1, 5), 4: (1, 5)}  # 30 / 10
    assign = balance(where, 2)
    assert assign[3] == 1 and assign[4] == 1  # only rank 0 gives groups away
    assert loads(where, assign, 2) == [20, 20] and moved(where, assign) == 1


def test_zero_token_groups_are_never_moved():
    where = {0: (0, 0), 1: (0, 0), 2: (0, 6), 3: (0, 6)}
    assign = balance(where, 2)
    assert assign[0] == 0 and assign[1] == 0 and loads(where, assign, 2) == [6, 6]


@pytest.mark.parametrize("where, n_ranks", [
    ({0: (0, 90), 1: (0, 10), 2: (0, 40), 3: (0, 40), 4: (0, 5)}, 2),  # test_sharding.py's case
    ({0: (1, 9), 1: (1, 9), 2: (1, 9), 3: (0, 9)}, 2),
    ({0: (0, 30), 1: (0, 30), 2: (0, 30), 3: (1, 10), 4: (2, 10)}, 3),
    ({g: (g % 2, 7 + g) for g in range(8)}, 4),
])
def test_hand_made_loads_end_within_the_smallest_group_of_each_other(where, n_ranks):
    before = loads(where, held(where), n_ranks)
    assign = balance(where, n_ranks)
    after = loads(where, assign, n_ranks)
    assert sum(after) == sum(before)
    assert max(after) <= max(before)
    assert max(after) - min(after) <= min(t for _, t in where.values())


def test_loads_can_stay_apart_by_more_than_the_smallest_group_when_no_partition_does_better():
    # 18 vs 11 is the best any split of {10, 8} + {10, 1} can do, yet the smallest group has 1 token:
    # "within the smallest group" is not a property any balancer can promise.
    where = {0: (0, 10), 1: (0, 1), 2: (1, 10), 3: (1, 8)}
    assign = balance(where, 2)
    assert loads(where, assign, 2) == [11, 18]


@pytest.mark.parametrize("seed", range(8))
def test_random_balancing_never_worsens_the_max_load_and_stops_only_when_no_move_helps(seed):
    rng = random.Random(seed)
    n_ranks = rng.randint(2, 5)
    # held where a skewed start would leave them: mostly on rank 0
    where = {g: (rng.choice([0, 0, 0, rng.randrange(n_ranks)]), rng.randint(1, 400)) for g in range(rng.randint(1, 40))}
    before = loads(where, held(where), n_ranks)
    assign = balance(where, n_ranks)
    after = loads(where, assign, n_ranks)
    assert sorted(assign) == sorted(where) and all(0 <= r < n_ranks for r in assign.values())
    assert sum(after) == sum(before)
    assert max(after) <= max(before)
    # The stopping rule: every group left on the most loaded rank is at least as big as the gap to
    # the least loaded rank. So the ranks end within that rank's smallest group of each other, and
    # the max load is at most the mean load plus that group.
    hi = max(range(n_ranks), key=lambda r: (after[r], -r))
    smallest_on_hi = min(where[g][1] for g, r in assign.items() if r == hi)
    assert max(after) - min(after) <= smallest_on_hi
    assert max(after) <= sum(after) / n_ranks + smallest_on_hi


@pytest.mark.parametrize("seed", range(4))
def test_random_similar_groups_on_one_of_two_ranks_end_within_the_smallest_group_of_each_other(seed):
    # The usual case: same group size, similar lengths, a batch that all sits on one rank.
    rng = random.Random(100 + seed)
    where = {g: (0, rng.randint(200, 300)) for g in range(rng.randint(8, 40))}
    after = loads(where, balance(where, 2), 2)
    assert max(after) - min(after) <= min(t for _, t in where.values())


@pytest.mark.xfail(strict=True, reason="balance() only tries moving one group from the most to the least loaded "
                   "rank; with 3 ranks it stops at loads 40/70/60 (gap 30 > smallest group 10) although the split "
                   "{40,20} {30,30} {40,10} gives 60/60/50 (needs a move into a middle rank)")
def test_three_ranks_end_within_the_smallest_group_when_a_split_allows_it():
    where = {0: (0, 40), 1: (0, 40), 2: (0, 30), 3: (1, 30), 4: (2, 20), 5: (2, 10)}  # 110 / 30 / 30
    after = loads(where, balance(where, 3), 3)
    assert max(after) == 60
    assert max(after) - min(after) <= 10


@pytest.mark.xfail(strict=True, reason="balance() is greedy: the module docstring says a step 'moves as few as it "
                   "can', but here it moves 3 groups (29, then 9, then 1) where 2 (26 and 13) give the same "
                   "perfect 39/39 split")
def test_balance_moves_no_more_groups_than_needed_for_its_own_result():
    where = {0: (0, 9), 1: (0, 13), 2: (0, 26), 3: (0, 1), 4: (0, 29)}
    assign = balance(where, 2)
    assert loads(where, assign, 2) == [39, 39]
    assert moved(where, assign) == 2


# ---- plan_step ------------------------------------------------------------------------------

def test_plan_lists_a_move_at_the_holder_and_the_group_at_the_receiver():
    where = {0: (0, 1), 1: (0, 1), 2: (0, 1), 3: (0, 1), 4: (0, 8)}
    plans = plan_step(7, where, 2)
    assert plans == [RunStep(step=7, groups=[0, 1, 2, 3], moves={4: 1}), RunStep(step=7, groups=[4], moves={})]


def test_plan_of_balanced_input_has_no_moves():
    where = {0: (1, 5), 1: (0, 5), 2: (1, 5), 3: (0, 5)}
    plans = plan_step(0, where, 2)
    assert [p.groups for p in plans] == [[1, 3], [0, 2]] and all(p.moves == {} for p in plans)


def test_plan_gives_every_rank_a_runstep_even_without_groups():
    plans = plan_step(3, {0: (0, 10)}, 3)
    assert plans == [RunStep(3, [0], {}), RunStep(3, [], {}), RunStep(3, [], {})]
    plans[1].moves[5] = 0  # separate dicts per rank
    assert plans[2].moves == {}


@pytest.mark.parametrize("seed", range(6))
def test_random_plans_train_every_group_exactly_once_and_list_each_move_at_its_holder(seed):
    rng = random.Random(seed)
    n_ranks = rng.randint(1, 5)
    where = {g: (rng.randrange(n_ranks), rng.randint(1, 1000)) for g in rng.sample(range(10_000), rng.randint(0, 30))}
    assign = check_plans(where, plan_step(seed, where, n_ranks), n_ranks, seed)
    assert assign == balance(where, n_ranks)


# ---- merge_results --------------------------------------------------------------------------

def test_merged_results_come_from_rank_zero_whatever_order_the_ranks_answered_in():
    done = [StepDone(rank=1, step=2, stats={"loss": 9.0}, weights_path=""),
            StepDone(rank=0, step=2, stats={"loss": 0.5, "n_tokens": 100.0}, weights_path="/ckpt/v3"),
            StepDone(rank=2, step=2, stats={"loss": 7.0}, weights_path="")]
    stats, path = merge_results(done)
    assert stats == {"loss": 0.5, "n_tokens": 100.0} and path == "/ckpt/v3"
    stats["loss"] = 1.0
    assert done[1].stats["loss"] == 0.5  # a copy, not rank 0's dict
