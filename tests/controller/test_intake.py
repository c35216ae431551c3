import pytest

from areal_flow.controller.intake import FilterStreak, Intake, group_problem, outside_range, success_rate
from areal_flow.transport.messages import DROP, Finish, GroupMeta, SampleMeta

TOKEN_KEYS = ["prompt_ids", "output_ids", "behav_logprobs", "versions"]
OUTPUT_KEYS = ["output_ids", "behav_logprobs", "versions"]


def sample(gid: int, i: int, prompt: int = 4, answer: int = 5, reward: float | None = 1.0, **lengths: int) -> SampleMeta:
    ls = {"prompt_ids": prompt, "output_ids": answer, "behav_logprobs": answer, "versions": answer}
    ls.update(lengths)
    return SampleMeta(f"g{gid}-{i}", i, ls, {0: answer}, {} if reward is None else {"rewards": reward}, Finish.STOP)


def meta(gid: int, size: int = 2, **kw) -> GroupMeta:
    return GroupMeta(gid, "reward0", [sample(gid, i, **kw) for i in range(size)])


def intake(n_ranks: int = 2, group_size: int = 2) -> Intake:
    return Intake(group_size, n_ranks, token_keys=list(TOKEN_KEYS), output_keys=list(OUTPUT_KEYS),
                  prompt_key="prompt_ids", reward_key="rewards")


def problem(m: GroupMeta, group_size: int = 2) -> str | None:
    return group_problem(m, group_size, TOKEN_KEYS, OUTPUT_KEYS, "rewards")


# ---- group_problem (what test_sharding.py's test_a_group_that_cannot_be_trained_is_recognised checked) ----

def test_a_complete_group_has_no_problem():
    assert problem(meta(1)) is None


def test_prompt_and_answer_lengths_may_differ_without_a_problem():
    assert problem(meta(1, prompt=100, answer=3)) is None  # only the per-answer-token keys must agree


def test_a_wrong_sample_count_is_a_problem():
    m = meta(1, size=2)
    assert "1 samples, want 2" in problem(GroupMeta(1, "w", m.samples[:1]))
    assert "3 samples, want 2" in problem(meta(1, size=3))


def test_a_missing_reward_is_a_problem():
    assert "g2-0 lacks ['rewards']" in problem(meta(2, reward=None))


def test_a_missing_per_token_key_names_the_sample_and_key():
    m = meta(3)
    del m.samples[1].lengths["behav_logprobs"]
    assert "g3-1 lacks ['behav_logprobs']" in problem(m)


def test_per_answer_token_arrays_of_different_lengths_are_a_problem():
    m = meta(3)
    m.samples[0].lengths["behav_logprobs"] = 4
    assert "g3-0 has per-token arrays of different lengths [4, 5]" in problem(m)


# ---- Intake ---------------------------------------------------------------------------------

def test_tokens_of_a_group_are_prompt_plus_answer_of_every_sample():
    it = intake()
    it.accept(meta(7, prompt=4, answer=5))
    assert it.tokens(7) == 2 * (4 + 5)  # behav_logprobs/versions are not counted again


def test_an_accepted_group_goes_to_the_least_loaded_rank():
    it = intake(n_ranks=3)
    assert it.accept(meta(0, answer=96)) == (0, None)  # 200 tokens; ties go to the lowest rank
    assert it.accept(meta(1, answer=46)) == (1, None)  # 100
    assert it.accept(meta(2, answer=21)) == (2, None)  # 50
    assert it.load() == [200, 100, 50]
    assert it.accept(meta(3, answer=21)) == (2, None)  # rank 2 had the fewest tokens
    assert it.accept(meta(4, answer=1)) == (1, None)  # 100 < 200, and 100 == 100: lowest rank wins
    assert it.load() == [200, 110, 100]
    assert it.location == {0: 0, 1: 1, 2: 2, 3: 2, 4: 1}
    assert len(it) == 5


@pytest.mark.parametrize("bad, why", [
    (GroupMeta(5, "w", [sample(5, 0)]), "1 samples, want 2"),
    (meta(5, reward=None), "lacks ['rewards']"),
    (meta(5, versions=4), "different lengths [4, 5]"),
])
def test_an_untrainable_group_is_dropped_with_the_reason_and_not_held(bad, why):
    it = intake()
    rank, reason = it.accept(bad)
    assert rank == DROP and why in reason
    assert it.dropped == 1
    assert len(it) == 0 and it.location == {} and it.load() == [0, 0]


def test_a_group_arriving_twice_is_dropped_and_the_first_copy_stays_where_it_was():
    it = intake()
    assert it.accept(meta(9, answer=10)) == (0, None)
    before = it.load()
    rank, reason = it.accept(meta(9, answer=500))
    assert rank == DROP and "group 9 arrived twice" in reason
    assert it.location == {9: 0} and it.load() == before and it.tokens(9) == 2 * (4 + 10)


def test_a_dropped_or_trained_group_id_is_refused_when_it_comes_again():
    it = intake()
    assert it.accept(meta(1, reward=None))[0] == DROP
    assert it.accept(meta(1)) == (DROP, "group 1 arrived twice")  # even if now complete
    it.accept(meta(2))
    it.take([2])
    assert it.accept(meta(2)) == (DROP, "group 2 arrived twice")


def test_take_returns_metadata_rank_and_tokens_and_removes_the_groups():
    it = intake()
    metas = [meta(g, answer=a) for g, a in [(0, 10), (1, 20), (2, 30)]]
    for m in metas:
        it.accept(m)
    assert it.location == {0: 0, 1: 1, 2: 0}
    taken = it.take([2, 0])
    assert taken == {2: (metas[2], 0, 2 * 34), 0: (metas[0], 0, 2 * 14)}
    assert set(it.groups) == {1} and it.location == {1: 1}
    assert it.load() == [0, 2 * 24]
    assert it.accept(meta(3)) == (0, None)  # rank 0 is empty again, so it gets the next group


def test_take_of_an_unknown_group_raises_and_removes_nothing():
    it = intake()
    it.accept(meta(0))
    with pytest.raises(KeyError, match=r"\[5\]"):
        it.take([0, 5])
    assert set(it.groups) == {0} and it.location == {0: 0}


def test_load_counts_only_untrained_groups_per_rank():
    it = intake(n_ranks=2)
    assert it.load() == [0, 0]
    it.accept(meta(0, answer=6))  # 20 tokens -> rank 0
    it.accept(meta(1, answer=1))  # 10 tokens -> rank 1
    it.accept(meta(2, answer=1))  # 10 tokens -> rank 1 (10 < 20)
    assert it.load() == [20, 20]
    it.take([1])
    assert it.load() == [20, 10]


# ---- dynamic filtering -------------------------------------------------------------------------

def group_with(rewards: list[float]) -> GroupMeta:
    return GroupMeta(7, "reward0", [sample(7, i, reward=r) for i, r in enumerate(rewards)])


def test_success_rate_counts_answers_with_reward_at_least_one_shaped_or_not():
    assert success_rate(group_with([5.0, -5.0, -5.0, 5.0]), "rewards") == 0.5  # AReaL's ±5 shaping
    assert success_rate(group_with([1.0, 0.0, 0.0, 0.0]), "rewards") == 0.25
    assert success_rate(group_with([0.99, 0.5, 0.0, 0.0]), "rewards") == 0.0  # partial credit is not success


@pytest.mark.parametrize("rewards, kept", [
    ([0.0] * 8, False),  # all wrong: no advantage, no gradient
    ([1.0] * 8, False),  # all right: likewise
    ([1.0] + [0.0] * 7, True),  # 0.125 is inside [0.05, 0.95]
    ([1.0] * 7 + [0.0], True),
])
def test_groups_outside_the_success_rate_range_are_named_with_their_rate(rewards, kept):
    why = outside_range(group_with(rewards), "rewards", [0.05, 0.95])
    assert (why is None) == kept
    if not kept:
        assert why == f"success rate {success_rate(group_with(rewards), 'rewards'):.2f} outside [0.05, 0.95]"
    assert outside_range(group_with(rewards), "rewards", None) is None  # no range: every group trains


# ---- FilterStreak: a run whose filter drops every group stops ----

def test_a_streak_of_dropped_groups_stalls_at_its_limit_and_a_kept_group_resets_it():
    streak = FilterStreak(limit=3)
    for gid in range(2):
        streak.dropped(meta(gid, reward=-5.0), "rewards")
    assert not streak.stalled
    streak.kept()  # a group inside the range: the run still trains
    for gid in range(2, 4):
        streak.dropped(meta(gid, reward=-5.0), "rewards")
    assert not streak.stalled and streak.count == 2
    streak.dropped(meta(4, reward=1.0), "rewards")
    assert streak.stalled
    assert streak.describe() == "mean reward -3, 2 of 6 answers correct (reward >= 1)"


def test_a_streak_without_a_limit_never_stalls():
    streak = FilterStreak(limit=0)
    for gid in range(100):
        streak.dropped(meta(gid), "rewards")
    assert not streak.stalled
