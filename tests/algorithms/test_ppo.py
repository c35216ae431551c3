import math

import pytest
import torch

from areal_flow.algorithms.ppo import decoupled_ppo_loss


def _random_inputs(shape, seed):
    g = torch.Generator().manual_seed(seed)
    prox = -torch.rand(shape, generator=g, dtype=torch.float64) * 3
    logp = prox + 0.3 * torch.randn(shape, generator=g, dtype=torch.float64)  # ratios around 1, some clipped
    behav = prox + 0.5 * torch.randn(shape, generator=g, dtype=torch.float64)  # weights spread around 1
    adv = torch.randn(shape, generator=g, dtype=torch.float64)
    mask = torch.rand(shape, generator=g) < 0.8
    return logp, prox, behav, adv, mask


def _reference(logp, prox, behav, adv, mask, eps, eps_hi, cap, n_valid):
    """Per-token loop straight from the formula in docs/architecture.md; also the expected d loss / d logp per token."""
    flat = [t.reshape(-1).tolist() if t is not None else None for t in (logp, prox, behav, adv, mask)]
    lp, px, bh, a, m = flat
    eps_hi = eps if eps_hi is None else eps_hi
    n = max(sum(m), 1) if n_valid is None else n_valid
    total, grads = 0.0, []
    stats = dict(
        n_tokens=0, clipped_tokens=0, capped_tokens=0, ratio_sum=0.0, behav_weight_sum=0.0, behav_weight_max=0.0
    )
    for t in range(len(lp)):
        if not m[t]:
            grads.append(0.0)
            continue
        anchor = px[t] if px is not None else bh[t]
        r = math.exp(lp[t] - anchor)
        w = math.exp(px[t] - bh[t]) if px is not None else 1.0
        stats["n_tokens"] += 1
        stats["ratio_sum"] += r
        stats["behav_weight_sum"] += w
        stats["behav_weight_max"] = max(stats["behav_weight_max"], w)
        if px is not None and cap is not None and w > cap:
            stats["capped_tokens"] += 1
            w = 0.0
        r_clip = min(max(r, 1 - eps), 1 + eps_hi)
        is_clipped = -a[t] * r_clip > -a[t] * r
        stats["clipped_tokens"] += int(is_clipped)
        total += -w * min(r * a[t], r_clip * a[t])
        grads.append(0.0 if is_clipped else -a[t] * r * w / n)
    return total / n, torch.tensor(grads, dtype=torch.float64).reshape(logp.shape), stats


@pytest.mark.parametrize("shape", [(64,), (4, 16)])
@pytest.mark.parametrize(
    "eps_hi,cap,use_prox",
    [(None, None, True), (0.28, None, True), (None, 1.5, True), (0.28, 2.0, True), (None, None, False)],
)
def test_loss_stats_and_gradient_match_a_per_token_loop(shape, eps_hi, cap, use_prox):
    logp, prox, behav, adv, mask = _random_inputs(shape, seed=len(shape) + 10 * int(10 * (cap or 0)))
    prox = prox if use_prox else None
    logp.requires_grad_(True)
    loss, stats = decoupled_ppo_loss(
        logp, prox, behav, adv, mask, eps_clip=0.2, eps_clip_high=eps_hi, behav_weight_cap=cap
    )
    ref_loss, ref_grad, ref_stats = _reference(logp.detach(), prox, behav, adv, mask, 0.2, eps_hi, cap, None)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-10, abs=1e-12)
    for key, value in ref_stats.items():
        assert stats[key].item() == pytest.approx(value, rel=1e-10), key
        assert stats[key].ndim == 0 and not stats[key].requires_grad
    # The inputs must exercise every branch, or this test would prove little.
    assert 0 < ref_stats["clipped_tokens"] < ref_stats["n_tokens"]
    if cap is not None and use_prox:
        assert 0 < ref_stats["capped_tokens"] < ref_stats["n_tokens"]
    loss.backward()
    torch.testing.assert_close(logp.grad, ref_grad, rtol=1e-10, atol=1e-14)


def test_behaviour_weight_is_always_applied():
    logp, prox, _, adv, mask = _random_inputs((32,), seed=1)
    on_policy, _ = decoupled_ppo_loss(logp, prox, prox, adv, mask, eps_clip=0.2)
    # The same tokens sampled by an older policy that gave each of them e^0.5 less probability.
    stale, stats = decoupled_ppo_loss(logp, prox, prox - 0.5, adv, mask, eps_clip=0.2)
    assert stale.item() == pytest.approx(on_policy.item() * math.exp(0.5), rel=1e-10)
    assert stats["behav_weight_max"].item() == pytest.approx(math.exp(0.5))


def test_capped_tokens_are_dropped_but_stay_in_the_denominator():
    logp = torch.tensor([-1.0, -1.0, -1.0, -1.0], dtype=torch.float64, requires_grad=True)
    prox = torch.full((4,), -1.0, dtype=torch.float64)
    behav = torch.tensor([-1.0, -1.0, -4.0, -4.0], dtype=torch.float64)  # w = 1, 1, e^3, e^3
    adv = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    mask = torch.ones(4, dtype=torch.bool)
    loss, stats = decoupled_ppo_loss(logp, prox, behav, adv, mask, eps_clip=0.2, behav_weight_cap=5.0)
    # r = 1 everywhere: only tokens 0 and 1 count, divided by all 4 valid tokens.
    assert loss.item() == pytest.approx(-(1.0 + 2.0) / 4)
    assert stats["capped_tokens"].item() == 2
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([-1 / 4, -2 / 4, 0.0, 0.0])


def test_without_prox_it_is_plain_ppo_against_behaviour():
    logp, _, behav, adv, mask = _random_inputs((48,), seed=2)
    plain, stats = decoupled_ppo_loss(logp, None, behav, adv, mask, eps_clip=0.2, behav_weight_cap=0.5)
    # prox = behav makes w = 1 and r = exp(logp - behav): the same objective.
    same, _ = decoupled_ppo_loss(logp, behav, behav, adv, mask, eps_clip=0.2)
    assert plain.item() == pytest.approx(same.item(), rel=1e-12)
    assert stats["capped_tokens"].item() == 0 and stats["behav_weight_sum"].item() == mask.sum().item()
    # ...which is not the decoupled loss when prox differs from behav.
    _, prox, _, _, _ = _random_inputs((48,), seed=2)
    decoupled, _ = decoupled_ppo_loss(logp, prox, behav, adv, mask, eps_clip=0.2)
    assert decoupled.item() != pytest.approx(plain.item(), rel=1e-3)


def test_masked_positions_with_garbage_contribute_nothing_and_no_nan():
    logp, prox, behav, adv, mask = _random_inputs((40,), seed=3)
    clean, _ = decoupled_ppo_loss(logp, prox, behav, adv, mask, eps_clip=0.2)
    dirty = [t.clone() for t in (logp, prox, behav, adv)]
    garbage = torch.tensor([float("inf"), float("-inf"), float("nan")], dtype=torch.float64)
    for k, t in enumerate(dirty):
        t[~mask] = garbage[(torch.arange((~mask).sum()) + k) % 3]
    dirty[0].requires_grad_(True)
    loss, stats = decoupled_ppo_loss(*dirty, mask, eps_clip=0.2, behav_weight_cap=3.0)
    assert loss.item() == pytest.approx(
        decoupled_ppo_loss(logp, prox, behav, adv, mask, eps_clip=0.2, behav_weight_cap=3.0)[0].item()
    )
    assert all(torch.isfinite(v) for v in stats.values())
    loss.backward()
    assert torch.isfinite(dirty[0].grad).all()
    assert (dirty[0].grad[~mask] == 0).all()
    assert torch.isfinite(clean)


def test_global_token_count_makes_micro_batch_losses_add_up_to_the_full_mean():
    logp, prox, behav, adv, mask = _random_inputs((50,), seed=4)
    full, _ = decoupled_ppo_loss(logp, prox, behav, adv, mask, eps_clip=0.2)
    n = mask.sum().item()
    parts = [
        decoupled_ppo_loss(logp[s], prox[s], behav[s], adv[s], mask[s], eps_clip=0.2, n_valid_tokens=n)[0]
        for s in (slice(0, 17), slice(17, 50))
    ]
    assert (parts[0] + parts[1]).item() == pytest.approx(full.item(), rel=1e-12)


def test_an_all_masked_batch_gives_zero_loss():
    logp = torch.full((5,), float("nan"), requires_grad=True)
    loss, stats = decoupled_ppo_loss(
        logp, logp.detach(), logp.detach(), torch.ones(5), torch.zeros(5, dtype=torch.bool), eps_clip=0.2
    )
    assert loss.item() == 0.0 and stats["n_tokens"].item() == 0 and stats["behav_weight_max"].item() == 0
    loss.backward()
    assert (logp.grad == 0).all()


def test_shape_mismatch_is_rejected():
    with pytest.raises(ValueError, match="advantages has shape"):
        decoupled_ppo_loss(
            torch.zeros(4), None, torch.zeros(4), torch.zeros(3), torch.ones(4, dtype=torch.bool),
            eps_clip=0.2,
        )
