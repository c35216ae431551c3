"""The step diagnostics (algorithms/diagnostics.py): length buckets, advantage and loss share by
length under token- and sequence-mean aggregation, the behaviour weight's histogram, capped share
and effective sample size, on hand-built batches."""

import math

import numpy as np
import pytest
import torch

from areal_flow.algorithms import library
from areal_flow.algorithms.diagnostics import (
    BEHAV_WEIGHT_BIN,
    STALE,
    STALENESS_BUCKETS,
    STALEST_SHARE_LAST,
    STALEST_SHARE_MAX,
    behav_weight_bins,
    behav_weight_edges,
    ess_fraction,
    length_bucket_metrics,
    length_bucket_sums,
    length_buckets,
    stalest_shares,
    staleness_bucket,
    staleness_metrics,
)
from areal_flow.algorithms.inputs import TrainInputs
from areal_flow.algorithms.ppo import decoupled_ppo_loss
from areal_flow.config.schema import AlgorithmConfig


def test_buckets_are_the_quarters_of_the_budget_upper_bound_included():
    # max_new_tokens 8: q1 <= 2, q2 <= 4, q3 <= 6, q4 above (the budget itself, and beyond).
    assert length_buckets([0, 1, 2, 3, 4, 5, 6, 7, 8, 9], 8).tolist() == [0, 0, 0, 1, 1, 2, 2, 3, 3, 3]
    # 10: the bounds 2.5, 5, 7.5 are not whole tokens.
    assert length_buckets([2, 3, 5, 6, 7, 8, 10], 10).tolist() == [0, 1, 1, 2, 2, 3, 3]
    with pytest.raises(ValueError):
        length_buckets([1], 0)


# A batch under max_new_tokens = 8: lengths 1, 2 (q1), 3 (q2), 6 (q3), 8 and 7 (q4). The last answer
# has GAE-like advantages 1..7 of which only its first 3 tokens are in the loss.
LENGTHS = [1, 2, 3, 6, 8, 7]
ADVANTAGES = [np.array([1.0]), np.array([-1.0, -1.0]), np.full(3, 0.5), np.full(6, 2.0), np.full(8, -0.5),
              np.arange(1.0, 8.0)]
MASKS = [np.ones(n, dtype=bool) for n in LENGTHS[:-1]] + [np.array([True] * 3 + [False] * 4)]


def test_advantage_is_a_mean_per_answer_over_its_valid_tokens():
    m = length_bucket_metrics(length_bucket_sums(LENGTHS, ADVANTAGES, MASKS, None, 8))
    assert m["by_length/advantage/q1"] == pytest.approx((1.0 + -1.0) / 2)  # each answer counts once
    assert m["by_length/advantage/q2"] == pytest.approx(0.5)
    assert m["by_length/advantage/q3"] == pytest.approx(2.0)
    assert m["by_length/advantage/q4"] == pytest.approx((-0.5 + (1 + 2 + 3) / 3) / 2)  # masked tokens left out


def test_loss_share_under_token_mean_grows_with_length():
    sums = length_bucket_sums(LENGTHS, ADVANTAGES, MASKS, None, 8)
    # Σ |A| over valid tokens (every token weighs 1): q1 1 + 2, q2 1.5, q3 12, q4 4 + (1 + 2 + 3).
    per_bucket = {"q1": 3.0, "q2": 1.5, "q3": 12.0, "q4": 10.0}
    assert [sums[f"by_length/loss_weight/{b}"] for b in per_bucket] == pytest.approx(list(per_bucket.values()))
    m = length_bucket_metrics(sums)
    total = sum(per_bucket.values())
    for b, w in per_bucket.items():
        assert m[f"by_length/loss_share/{b}"] == pytest.approx(w / total)
    assert sum(m[f"by_length/loss_share/{b}"] for b in per_bucket) == pytest.approx(1.0)
    assert [sums[f"by_length/adv_seqs/{b}"] for b in per_bucket] == [2, 1, 1, 2]


def test_loss_share_under_sequence_mean_weighs_every_answer_alike():
    # The token weights the trainer passes for seq-mean-token-mean: 1/n over each answer's n valid tokens.
    weights, _ = library.aggregation(MASKS, AlgorithmConfig(loss_agg="seq-mean-token-mean", group_size=2))
    m = length_bucket_metrics(length_bucket_sums(LENGTHS, ADVANTAGES, MASKS, weights, 8))
    # Each answer's mean |A| over its valid tokens: q1 1 + 1, q2 0.5, q3 2, q4 0.5 + 2.
    per_bucket = {"q1": 2.0, "q2": 0.5, "q3": 2.0, "q4": 2.5}
    total = sum(per_bucket.values())
    for b, w in per_bucket.items():
        assert m[f"by_length/loss_share/{b}"] == pytest.approx(w / total)
    # Dr. GRPO (seq-mean-token-sum-norm): 1/max_new_tokens for every token, the token-mean shares.
    weights, _ = library.aggregation(MASKS, AlgorithmConfig(loss_agg="seq-mean-token-sum-norm", group_size=2,
                                                           max_new_tokens=8))
    drgrpo = length_bucket_metrics(length_bucket_sums(LENGTHS, ADVANTAGES, MASKS, weights, 8))
    token_mean = length_bucket_metrics(length_bucket_sums(LENGTHS, ADVANTAGES, MASKS, None, 8))
    assert drgrpo == pytest.approx(token_mean)


def test_empty_buckets_and_a_batch_without_signal_give_none():
    sums = length_bucket_sums([1, 2], [np.zeros(1), np.zeros(2)], [np.ones(1, bool), np.ones(2, bool)], None, 8)
    m = length_bucket_metrics(sums)
    assert m["by_length/advantage/q1"] == 0.0 and m["by_length/advantage/q2"] is None
    assert all(m[f"by_length/loss_share/q{k}"] is None for k in range(1, 5))  # no |A| anywhere
    # An answer without a valid token trains nothing: counted in no advantage mean.
    sums = length_bucket_sums([2], [np.ones(2)], [np.zeros(2, bool)], None, 8)
    assert sums["by_length/adv_seqs/q1"] == 0 and sums["by_length/loss_weight/q1"] == 0
    # A rank without samples still gives every key (it joins the all-reduce).
    assert length_bucket_sums([], [], [], None, 8) == {k: 0.0 for k in sums}
    assert length_bucket_metrics({}) == {}


def test_the_trainers_length_sums_add_up_over_ranks():
    from areal_flow.training.updates import length_bias

    inputs = TrainInputs([(np.zeros(2, np.int32), np.zeros(n, np.int32)) for n in LENGTHS],
                         {"advantages": ADVANTAGES, "behav_logprobs": [np.zeros(n) for n in LENGTHS]},
                         loss_mask=MASKS)
    alone = length_bias(inputs, 8, None)
    assert alone == length_bucket_sums(LENGTHS, ADVANTAGES, MASKS, None, 8)
    two_ranks = length_bias(inputs, 8, lambda t: 2 * t)  # the same batch again on another rank
    assert two_ranks == pytest.approx({k: 2 * v for k, v in alone.items()})


# ---- the behaviour weight ---------------------------------------------------------------------

def test_edges_are_log_symmetric_about_one_from_zero_and_include_the_cap():
    plain = behav_weight_edges(None)
    assert plain == [0.0, 0.125, 0.25, 0.5, 0.8, 0.95, 1.05, 1.25, 2.0, 4.0, 8.0]
    inner = plain[1:]
    for low, high in zip(inner[:5], reversed(inner[5:])):  # 1/8 and 8, ..., 0.95 and about 1/0.95
        assert math.log(low) == pytest.approx(-math.log(high), abs=0.005)
    five = behav_weight_edges(5.0)
    assert 5.0 in five and five == sorted(plain + [5.0])
    for cap in (8.0, 20.0):  # at least one edge above the cap, which is one itself
        edges = behav_weight_edges(cap)
        assert cap in edges and edges[-1] > cap and edges == sorted(edges)
    assert 0.3 in behav_weight_edges(5.0, floor=0.3)


def test_weight_histogram_counts_valid_tokens_in_right_closed_bins():
    edges = behav_weight_edges(5.0)  # 0, .125, .25, .5, .8, .95, 1.05, 1.25, 2, 4, 5, 8
    w = torch.tensor([0.0, 0.6, 1.0, 1.0000001, 0.95, 3.0, 5.0, 5.5, 8.0, 20.0, 1e6, 1.0],
                     dtype=torch.float64)
    mask = torch.tensor([True] * 10 + [False] * 2)  # the last two tokens are not in the loss
    bins = behav_weight_bins(w, mask, edges).tolist()
    assert len(bins) == len(edges) - 1 == 11 and sum(bins) == 10
    expected = [0] * 11
    # 0 in bin 0; .6 in (.5, .8]; 1 and 1 + 1e-7 in (.95, 1.05], .95 below it; 5 in (4, 5]; 8 in
    # (5, 8]; 20 in the open last bin.
    for i in (0, 3, 5, 5, 4, 8, 9, 10, 10, 10):
        expected[i] += 1
    assert bins == expected
    # The bins above the cap's edge hold exactly the weights over the cap.
    above = edges.index(5.0)
    assert sum(bins[above:]) == int(((w > 5.0) & mask).sum())
    # Any shape: padded [B, T] as packed [T].
    assert behav_weight_bins(w.reshape(3, 4), mask.reshape(3, 4), edges).tolist() == expected


def test_ess_fraction():
    assert ess_fraction(4.0, 4.0, 4) == 1.0  # four weights of 1
    assert ess_fraction(4.0, 10.0, 2) == pytest.approx(16 / 20)  # 1 and 3
    assert ess_fraction(0.0, 0.0, 0) is None


def test_loss_stats_give_the_weights_square_sum_and_histogram():
    # w = π_prox/π_behav = 1, 3, 0.6, 7 and a masked token; cap 5 catches the 7.
    w = torch.tensor([1.0, 3.0, 0.6, 7.0, 100.0], dtype=torch.float64)
    prox = torch.full((5,), -1.0, dtype=torch.float64)
    behav = prox - torch.log(w)
    mask = torch.tensor([True, True, True, True, False])
    _, stats = decoupled_ppo_loss(prox.clone(), prox, behav, torch.ones(5, dtype=torch.float64), mask,
                                  eps_clip=0.2, behav_weight_cap=5.0)
    valid = w[:4]
    assert stats["behav_weight_sum"].item() == pytest.approx(valid.sum().item())
    assert stats["behav_weight_sq_sum"].item() == pytest.approx((valid ** 2).sum().item())
    edges = behav_weight_edges(5.0)
    bins = [stats[BEHAV_WEIGHT_BIN.format(i)].item() for i in range(len(edges) - 1)]
    assert bins == behav_weight_bins(w, mask, edges).tolist() and sum(bins) == 4
    assert stats["capped_tokens"].item() == 1
    ess = ess_fraction(stats["behav_weight_sum"].item(), stats["behav_weight_sq_sum"].item(), sum(bins))
    assert ess == pytest.approx(11.6 ** 2 / (4 * (1 + 9 + 0.36 + 49)))
    # Without π_prox every weight is 1: all in the bin (.707, 1], ESS 1.
    _, plain = decoupled_ppo_loss(prox.clone(), None, behav, torch.ones(5, dtype=torch.float64), mask, eps_clip=0.2)
    assert plain[BEHAV_WEIGHT_BIN.format(5)].item() == 4  # (0.95, 1.05]
    assert ess_fraction(plain["behav_weight_sum"].item(), plain["behav_weight_sq_sum"].item(), 4) == 1.0


def test_staleness_buckets_group_versions_behind():
    d = torch.tensor([-1, 0, 1, 2, 3, 4, 5, 8, 9, 40])
    assert [STALENESS_BUCKETS[i] for i in staleness_bucket(d).tolist()] == [
        "0", "0", "1", "2", "3-4", "3-4", "5-8", "5-8", "9+", "9+"]


@pytest.mark.parametrize("kind", ["ppo", "cispo"])
def test_the_gradient_weight_by_staleness_is_the_losss_own_gradient(kind):
    """Per bucket, `grad` is Σ |∂loss/∂log π_θ(t)| × the denominator, as autograd gives it: clipped,
    masked-out (over the cap) and invalid tokens count 0, and the behaviour weights by age are the
    inputs' own."""
    g = torch.Generator().manual_seed(3)
    n = 40
    behav = -torch.rand(n, generator=g) * 2
    prox = behav + torch.randn(n, generator=g) * 0.6  # some weights past the cap of 1.5
    logp = (prox + torch.randn(n, generator=g) * 0.3).requires_grad_()
    adv = torch.randn(n, generator=g)
    mask = torch.rand(n, generator=g) > 0.2
    staleness = torch.randint(0, 12, (n,), generator=g)
    loss, stats = decoupled_ppo_loss(logp, prox, behav, adv, mask, eps_clip=0.2, kind=kind, behav_weight_cap=1.5,
                                     n_valid_tokens=float(mask.sum()), staleness=staleness)
    loss.backward()
    per_token = logp.grad.abs() * float(mask.sum())
    weight = torch.exp(prox - behav)
    bucket = staleness_bucket(staleness)
    for i, b in enumerate(STALENESS_BUCKETS):
        mine = mask & (bucket == i)
        assert float(stats[STALE.format(b, "tokens")]) == int(mine.sum())
        assert float(stats[STALE.format(b, "grad")]) == pytest.approx(float(per_token[mine].sum()), rel=1e-5, abs=1e-6)
        assert float(stats[STALE.format(b, "weight_sum")]) == pytest.approx(float(weight[mine].sum()), rel=1e-5)
        assert float(stats[STALE.format(b, "capped")]) == int((mine & (weight > 1.5)).sum())
    assert sum(float(stats[STALE.format(b, "capped")]) for b in STALENESS_BUCKETS) == float(stats["capped_tokens"]) > 0
    assert not any(float(stats[STALE.format(b, "grad")]) == 0 for b in STALENESS_BUCKETS
                   if float(stats[STALE.format(b, "tokens")]) > 2)  # not trivially zero


def test_without_staleness_the_loss_reports_none():
    x = torch.zeros(3)
    _, stats = decoupled_ppo_loss(x, x, x, x, torch.ones(3, dtype=torch.bool), eps_clip=0.2)
    assert not any(k.startswith("stale/") for k in stats)


def mb(grads: dict[str, float], tokens: dict[str, float]) -> dict[str, float]:
    out = {STALE.format(b, "tokens"): tokens.get(b, 0.0) for b in STALENESS_BUCKETS}
    out.update({STALE.format(b, "grad"): grads.get(b, 0.0) for b in STALENESS_BUCKETS})
    return out


def test_the_stalest_share_is_of_the_steps_stalest_bucket_in_each_minibatch():
    # The step's stalest tokens are 3-4 versions behind; the first minibatch has none of them.
    each = [mb({"0": 1.0, "1": 1.0}, {"0": 5, "1": 5}), mb({"0": 1.0, "3-4": 3.0}, {"0": 2, "3-4": 4}),
            mb({"1": 1.0, "3-4": 1.0}, {"1": 1, "3-4": 1})]
    assert stalest_shares(each) == {STALEST_SHARE_MAX: 0.75, STALEST_SHARE_LAST: 0.5}
    assert stalest_shares([{"loss": 1.0}]) == {}  # a loss without staleness sums
    assert stalest_shares([mb({}, {"0": 3})]) == {STALEST_SHARE_MAX: 0.0, STALEST_SHARE_LAST: 0.0}  # no gradient


def test_staleness_metrics_per_bucket_with_tokens():
    stats = mb({"0": 3.0, "5-8": 1.0}, {"0": 10, "5-8": 4})
    stats.update({STALE.format(b, w): 0.0 for b in STALENESS_BUCKETS for w in ("weight_sum", "weight_max", "capped")})
    stats.update({STALE.format("0", "weight_sum"): 10.0, STALE.format("0", "weight_max"): 1.0,
                  STALE.format("5-8", "weight_sum"): 10.0, STALE.format("5-8", "weight_max"): 6.0,
                  STALE.format("5-8", "capped"): 1.0, STALEST_SHARE_MAX: 0.4})
    out = staleness_metrics(stats)
    assert out == {"stale/0/tokens": 10, "stale/0/weight_mean": 1.0, "stale/0/weight_max": 1.0,
                   "stale/0/capped_fraction": 0.0, "stale/0/grad_share": 0.75,
                   "stale/5-8/tokens": 4, "stale/5-8/weight_mean": 2.5, "stale/5-8/weight_max": 6.0,
                   "stale/5-8/capped_fraction": 0.25, "stale/5-8/grad_share": 0.25, STALEST_SHARE_MAX: 0.4}
    assert staleness_metrics({"loss": 1.0}) == {}
