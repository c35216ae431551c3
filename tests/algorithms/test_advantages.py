import pytest
import torch

from areal_flow.algorithms.advantages import group_normalized_advantages


def test_each_group_is_standardised_with_its_own_mean_and_unbiased_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 5.0, 7.0, 9.0])
    adv = group_normalized_advantages(rewards, group_size=4, eps=0.0)
    for block in adv.reshape(2, 4):
        assert block.mean().abs() < 1e-6
        assert block.std(unbiased=True) == pytest.approx(1.0, abs=1e-6)
    # Group 2: mean 6, unbiased std sqrt(20/3); the first sample sits 3 below the mean.
    assert adv[4].item() == pytest.approx(-3.0 / (20.0 / 3.0) ** 0.5, rel=1e-6)


def test_eps_is_added_to_the_std():
    rewards = torch.tensor([0.0, 2.0])  # mean 1, unbiased std sqrt(2)
    adv = group_normalized_advantages(rewards, group_size=2, eps=0.5)
    assert adv.tolist() == pytest.approx([-1 / (2**0.5 + 0.5), 1 / (2**0.5 + 0.5)])


def test_groups_are_contiguous_blocks_not_strided():
    rewards = torch.tensor([0.0, 1.0, 10.0, 11.0])
    adv = group_normalized_advantages(rewards, group_size=2)
    # Contiguous: [0,1] and [10,11] are both "low, high"; strided grouping would give [-,-,+,+].
    assert adv[0] < 0 < adv[1] and adv[2] < 0 < adv[3]
    assert adv[0].item() == pytest.approx(adv[2].item())


def test_identical_rewards_and_singleton_groups_give_zeros():
    same = group_normalized_advantages(torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0]), group_size=3)
    assert torch.equal(same[:3], torch.zeros(3))
    assert not torch.isnan(same).any()
    singles = group_normalized_advantages(torch.tensor([0.3, 1.0, -2.0]), group_size=1)
    assert torch.equal(singles, torch.zeros(3))


def test_dr_grpo_only_centres():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 5.0, 5.0])
    adv = group_normalized_advantages(rewards, group_size=3, scale_by_std=False)
    # Group means are 1/3 and 10/3; nothing is divided by the std.
    assert adv.tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3, -10 / 3, 5 / 3, 5 / 3])


def test_integer_rewards_are_accepted():
    adv = group_normalized_advantages(torch.tensor([0, 1, 1, 1]), group_size=2)
    assert adv.dtype.is_floating_point
    assert adv[0] < 0 < adv[1] and adv[2] == 0 and adv[3] == 0


def test_bad_shapes_are_rejected_with_a_message():
    with pytest.raises(ValueError, match="divisible by group_size"):
        group_normalized_advantages(torch.zeros(5), group_size=2)
    with pytest.raises(ValueError, match="1-D"):
        group_normalized_advantages(torch.zeros(2, 2), group_size=2)


# ---------------------------------------------------------------- normalize

import math  # noqa: E402

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from areal_flow.algorithms.advantages import LEVELS, gae, normalize, token_rewards  # noqa: E402

finite = st.floats(min_value=-10.0, max_value=10.0, allow_nan=False, allow_infinity=False)
# Multiples of 1/8: float64 sums of a few of them are exact, so results do not depend on summation order
# and a nearly flat group (std ~1e-12, where any variance formula loses its digits) cannot be drawn.
eighths = st.integers(-80, 80).map(lambda i: i / 8)


@st.composite
def grouped_tokens(draw, max_groups=3, max_group_size=4, max_t=5):
    """(x [N, T] float64, mask [N, T] bool, group_size) with N a multiple of group_size."""
    group_size = draw(st.integers(1, max_group_size))
    n = group_size * draw(st.integers(1, max_groups))
    t = draw(st.integers(1, max_t))
    x = torch.tensor(draw(st.lists(eighths, min_size=n * t, max_size=n * t)), dtype=torch.float64).reshape(n, t)
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=n * t, max_size=n * t))).reshape(n, t)
    return x, mask, group_size


@settings(max_examples=50, deadline=None)
@given(st.data())
def test_group_level_gives_zero_mean_and_unit_std_per_group(data):
    group_size = data.draw(st.integers(2, 5))
    n = group_size * data.draw(st.integers(1, 3))
    x = torch.tensor(data.draw(st.lists(eighths, min_size=n, max_size=n)), dtype=torch.float64)
    unbiased = data.draw(st.booleans())
    out = normalize(x, group_size=group_size, std_unbiased=unbiased, eps=0.0)
    for xs, block in zip(x.reshape(-1, group_size), out.reshape(-1, group_size)):
        assert abs(block.mean().item()) < 1e-9
        if xs.std().item() > 0:  # a flat group is all zeros instead (its own test)
            assert block.std(unbiased=unbiased).item() == pytest.approx(1.0, abs=1e-9)


def test_biased_and_unbiased_std():
    x = torch.tensor([0.0, 2.0, 5.0, 5.0])  # group 1: mean 1, unbiased std sqrt(2), biased std 1
    biased = normalize(x, group_size=2, std_unbiased=False, eps=0.0)
    unbiased = normalize(x, group_size=2, std_unbiased=True, eps=0.0)
    assert biased.tolist() == pytest.approx([-1.0, 1.0, 0.0, 0.0])
    assert unbiased.tolist() == pytest.approx([-1 / math.sqrt(2), 1 / math.sqrt(2), 0.0, 0.0])


def test_batch_level_statistics_are_over_the_valid_tokens():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, -50.0, 6.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, False, True]])
    out = normalize(x, group_size=1, mean_level="batch", std_level="batch", eps=0.0, mask=mask)
    valid = x[mask]  # 1, 2, 3, 6: mean 3, unbiased variance (4 + 1 + 0 + 9) / 3
    expected = (x - valid.mean()) / valid.std(unbiased=True)
    assert torch.allclose(out[mask], expected[mask])
    assert out[~mask].eq(0).all()
    # The hand value of one token, from the numbers in the comment above.
    assert out[1, 2].item() == pytest.approx(3 / math.sqrt(14 / 3))


@settings(max_examples=50, deadline=None)
@given(grouped_tokens(), st.booleans())
def test_batch_level_matches_torch_over_the_masked_tokens(case, unbiased):
    x, mask, group_size = case
    out = normalize(x, group_size=group_size, mean_level="batch", std_level="batch",
                    std_unbiased=unbiased, eps=0.0, mask=mask)
    valid = x[mask]
    if valid.numel() <= 1 or valid.std().item() == 0:
        return
    expected = (valid - valid.mean()) / valid.std(unbiased=unbiased)
    assert torch.allclose(out[mask], expected, atol=1e-9)


def test_leave_one_out_centres_on_the_other_rows():
    out = normalize(torch.tensor([1.0, 0.0, 0.0, 1.0]), group_size=4, leave_one_out=True, std_level="none")
    assert out.tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    # r_i - mean_{j != i} r_j, written out for an arbitrary group.
    r = torch.tensor([3.0, -1.0, 0.5, 2.0, 7.0, 7.5], dtype=torch.float64)
    out = normalize(r, group_size=3, leave_one_out=True, std_level="none")
    for g in range(2):
        block = r[3 * g: 3 * g + 3]
        for i in range(3):
            others = torch.cat([block[:i], block[i + 1:]])
            assert out[3 * g + i].item() == pytest.approx((block[i] - others.mean()).item())


def test_leave_one_out_over_tokens_uses_the_other_rows_valid_tokens():
    x = torch.tensor([[1.0, 1.0, 9.0], [0.0, 9.0, 9.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    out = normalize(x, group_size=2, leave_one_out=True, std_level="none", mask=mask)
    # Row 0 is centred on row 1's one valid token (0), row 1 on row 0's two valid tokens (mean 1).
    assert out.tolist() == [[1.0, 1.0, 0.0], [-1.0, 0.0, 0.0]]


def test_leave_one_out_with_singleton_groups_gives_zeros():
    out = normalize(torch.tensor([0.3, 1.0, -2.0]), group_size=1, leave_one_out=True)
    assert torch.equal(out, torch.zeros(3))


@settings(max_examples=50, deadline=None)
@given(grouped_tokens())
def test_none_none_is_the_identity_at_valid_positions(case):
    x, mask, group_size = case
    out = normalize(x, group_size=group_size, mean_level="none", std_level="none", mask=mask)
    assert torch.equal(out[mask], x[mask])
    assert out[~mask].eq(0).all()


@settings(max_examples=50, deadline=None)
@given(grouped_tokens(), st.sampled_from(LEVELS), st.sampled_from(LEVELS), st.booleans(),
       st.sampled_from([math.inf, -math.inf, math.nan, 1e30]))
def test_masked_garbage_changes_nothing_at_valid_positions(case, mean_level, std_level, loo, garbage):
    x, mask, group_size = case
    loo = loo and mean_level == "group"
    kwargs = dict(group_size=group_size, mean_level=mean_level, std_level=std_level, leave_one_out=loo, mask=mask)
    clean = normalize(x, **kwargs)
    dirty = normalize(torch.where(mask, x, torch.full_like(x, garbage)), **kwargs)
    assert torch.equal(clean, dirty)
    assert dirty[~mask].eq(0).all() and torch.isfinite(dirty).all()


def _simulated_ranks(halves, **kwargs):
    """Run `normalize` on each half as one data-parallel rank would: a first pass records what each rank
    would send to the all-reduce, a second one gives every rank the sum of both ranks' tensors."""
    sent = {}

    def recorder(rank):
        def record(t):
            sent[rank] = t.clone()
            return t
        return record

    for rank, (x, mask) in enumerate(halves):
        normalize(x, mask=mask, all_reduce=recorder(rank), **kwargs)
    outs = []
    for rank, (x, mask) in enumerate(halves):
        outs.append(normalize(x, mask=mask, all_reduce=lambda t, rank=rank: t + sent[1 - rank], **kwargs))
    return outs


@settings(max_examples=50, deadline=None)
@given(grouped_tokens(max_groups=4), st.sampled_from(LEVELS), st.sampled_from(LEVELS), st.booleans())
def test_all_reduced_sums_make_two_ranks_agree_with_the_whole_batch(case, mean_level, std_level, unbiased):
    x, mask, group_size = case
    n_groups = x.shape[0] // group_size
    split = group_size * (n_groups // 2)  # whole groups on each rank; rank 0 may hold none
    kwargs = dict(group_size=group_size, mean_level=mean_level, std_level=std_level, std_unbiased=unbiased)
    whole = normalize(x, mask=mask, **kwargs)
    outs = _simulated_ranks([(x[:split], mask[:split]), (x[split:], mask[split:])], **kwargs)
    # Exact sums on both sides: the same statistics, bit for bit.
    assert torch.equal(torch.cat(outs), whole)


def test_group_levels_never_all_reduce():
    def forbidden(t):
        raise AssertionError("group-level statistics must not all-reduce")

    x = torch.tensor([1.0, 0.0, 0.0, 0.0])
    normalize(x, group_size=2, all_reduce=forbidden)
    normalize(x, group_size=2, leave_one_out=True, std_level="none", all_reduce=forbidden)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("value", [0.1, 1 / 3, -7.7, 1e4 + 0.3])
def test_equal_values_in_a_group_give_exactly_zero(dtype, value):
    x = torch.full((6, 4), value, dtype=dtype)
    x[3:] = torch.arange(12, dtype=dtype).reshape(3, 4)  # a second group that does vary
    mask = torch.ones(6, 4, dtype=torch.bool)
    mask[1, 2:] = False
    for loo in (False, True):
        out = normalize(x, group_size=3, mask=mask, leave_one_out=loo)
        assert torch.equal(out[:3], torch.zeros(3, 4, dtype=dtype))
        assert out.dtype == dtype


def test_normalize_rejects_bad_arguments_with_a_message():
    with pytest.raises(ValueError, match=r"\(5\).*group_size \(2\)"):
        normalize(torch.zeros(5), group_size=2)
    with pytest.raises(ValueError, match="group.*batch.*none"):
        normalize(torch.zeros(4), group_size=2, mean_level="token")
    with pytest.raises(ValueError, match="std_level"):
        normalize(torch.zeros(4), group_size=2, std_level=None)
    with pytest.raises(ValueError, match="leave_one_out"):
        normalize(torch.zeros(4), group_size=2, mean_level="batch", leave_one_out=True)
    with pytest.raises(ValueError, match="mask"):
        normalize(torch.zeros(4, 3), group_size=2, mask=torch.ones(4, 2, dtype=torch.bool))


# ---------------------------------------------------------------- gae and token rewards

@st.composite
def token_rows(draw, max_n=3, max_t=6):
    n, t = draw(st.integers(1, max_n)), draw(st.integers(1, max_t))

    def tensor(elements):
        return torch.tensor(draw(st.lists(elements, min_size=n * t, max_size=n * t))).reshape(n, t)

    return tensor(finite).double(), tensor(finite).double(), tensor(st.booleans())


@settings(max_examples=50, deadline=None)
@given(token_rows())
def test_gae_with_unit_discounts_and_zero_values_is_the_return_to_go(case):
    rewards, _, mask = case
    adv, returns = gae(rewards, torch.zeros_like(rewards), mask, gamma=1.0, lam=1.0)
    to_go = (rewards * mask).flip(1).cumsum(1).flip(1)
    assert torch.allclose(adv[mask], to_go[mask])
    assert torch.equal(returns, adv)
    assert adv[~mask].eq(0).all()


def test_gae_hand_example():
    gamma, lam = 0.9, 0.8
    # One row of 3 valid tokens and a padding slot; r = [0, 0, 1], V = [0.5, 0.6, 0.7].
    rewards = torch.tensor([[0.0, 0.0, 1.0, 5.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.6, 0.7, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, False]])
    adv, returns = gae(rewards, values, mask, gamma, lam)
    d2 = 1.0 - 0.7                # the sequence ends: no value after the last token
    d1 = 0.0 + gamma * 0.7 - 0.6
    d0 = 0.0 + gamma * 0.6 - 0.5
    a2 = d2
    a1 = d1 + gamma * lam * a2
    a0 = d0 + gamma * lam * a1
    assert adv[0].tolist() == pytest.approx([a0, a1, a2, 0.0])
    assert returns[0].tolist() == pytest.approx([a0 + 0.5, a1 + 0.6, a2 + 0.7, 0.0])


@settings(max_examples=50, deadline=None)
@given(st.data())
def test_gae_skips_a_masked_middle_token_as_if_it_were_absent(data):
    t = data.draw(st.integers(3, 7))
    k = data.draw(st.integers(1, t - 2))
    rewards = torch.tensor([data.draw(st.lists(finite, min_size=t, max_size=t))], dtype=torch.float64)
    values = torch.tensor([data.draw(st.lists(finite, min_size=t, max_size=t))], dtype=torch.float64)
    gamma, lam = data.draw(st.floats(0.5, 1.0)), data.draw(st.floats(0.5, 1.0))
    mask = torch.ones(1, t, dtype=torch.bool)
    mask[0, k] = False
    adv, returns = gae(rewards, values, mask, gamma, lam)
    keep = [i for i in range(t) if i != k]
    adv_short, returns_short = gae(rewards[:, keep], values[:, keep], mask[:, keep], gamma, lam)
    assert torch.allclose(adv[:, keep], adv_short) and torch.allclose(returns[:, keep], returns_short)
    assert adv[0, k] == 0 and returns[0, k] == 0


@settings(max_examples=50, deadline=None)
@given(token_rows(), st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_gae_returns_are_advantages_plus_values(case, gamma, lam):
    rewards, values, mask = case
    adv, returns = gae(rewards, values, mask, gamma, lam)
    assert torch.allclose(returns[mask], (adv + values)[mask])
    assert returns[~mask].eq(0).all() and adv[~mask].eq(0).all()


def test_gae_ignores_garbage_at_masked_positions_and_gives_no_gradient():
    values = torch.tensor([[0.5, math.nan, 0.2, math.inf]], requires_grad=True)
    rewards = torch.tensor([[0.0, math.inf, 1.0, math.nan]])
    mask = torch.tensor([[True, False, True, False]])
    adv, returns = gae(rewards, values, mask, 0.9, 0.95)
    assert torch.isfinite(adv).all() and torch.isfinite(returns).all()
    assert not adv.requires_grad and not returns.requires_grad


def test_token_rewards_put_the_score_at_the_last_valid_token():
    scores = torch.tensor([1.0, 2.0, 3.0])
    mask = torch.tensor([[True, True, False], [False, False, False], [False, True, False]])
    out = token_rewards(scores, mask)
    assert out.tolist() == [[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 3.0, 0.0]]
    penalty = torch.tensor([[-0.1, -0.2, math.nan], [math.inf, -1.0, -1.0], [-0.3, -0.4, -0.5]])
    out = token_rewards(scores, mask, penalty)
    expected = torch.tensor([[-0.1, 1.0 - 0.2, 0.0], [0.0, 0.0, 0.0], [0.0, 3.0 - 0.4, 0.0]])
    assert torch.allclose(out, expected)


@settings(max_examples=50, deadline=None)
@given(token_rows())
def test_token_rewards_through_undiscounted_gae_give_every_valid_token_the_score(case):
    scores_2d, _, mask = case
    scores = scores_2d[:, 0]
    adv, _ = gae(token_rewards(scores, mask), torch.zeros(mask.shape, dtype=torch.float64), mask, 1.0, 1.0)
    expected = scores[:, None].expand_as(adv)
    assert torch.equal(adv[mask], expected[mask])


@pytest.mark.parametrize("shape", [(0,), (0, 5), (0, 0), (8, 0)])
@pytest.mark.parametrize("mean_level, std_level, loo", [("group", "group", False), ("group", "batch", True),
                                                        ("batch", "batch", False), ("none", "none", False)])
def test_a_rank_with_no_samples_or_no_tokens_gets_an_empty_result(shape, mean_level, std_level, loo):
    """A trainer rank that holds no group of a step (or whose answers have no tokens) still normalises,
    as a collective must: an empty result of its shape, and the batch sums it adds are zeros."""
    sums = []

    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        sums.append(t.clone())
        return t

    out = normalize(torch.zeros(shape), group_size=4, mean_level=mean_level, std_level=std_level,
                    leave_one_out=loo, all_reduce=all_reduce)
    assert out.shape == shape and out.numel() == 0
    assert all(bool((s == 0).all()) for s in sums) and bool(sums) == ("batch" in (mean_level, std_level))
