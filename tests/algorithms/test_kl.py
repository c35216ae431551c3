import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_flow.algorithms.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    behaviour_kl,
    kl_controller,
    kl_estimate,
    kl_k3,
)
from areal_flow.config.schema import AlgorithmConfig

logps = st.floats(min_value=-30.0, max_value=0.0, allow_nan=False)


def _one(d: float, estimator: str, clamp: float | None = 10.0) -> float:
    """The estimate for one token with logp − ref = d."""
    ref = -1.0
    return kl_estimate(torch.tensor([ref + d]), torch.tensor([ref]), torch.tensor([True]), estimator, clamp).item()


def test_hand_values_for_one_token():
    d = 0.5
    assert _one(d, "k1") == pytest.approx(d)
    assert _one(d, "k2") == pytest.approx(d * d / 2)
    assert _one(d, "k3") == pytest.approx(math.exp(-d) - 1 + d)
    assert _one(-d, "k3") == pytest.approx(math.exp(d) - 1 - d)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(logps, logps), min_size=1, max_size=8), st.sampled_from([None, 10.0]))
def test_k2_and_k3_are_non_negative(pairs, clamp):
    logp = torch.tensor([p for p, _ in pairs], dtype=torch.float64)
    ref = torch.tensor([r for _, r in pairs], dtype=torch.float64)
    mask = torch.ones_like(logp, dtype=torch.bool)
    for estimator in ("k2", "k3"):
        assert (kl_estimate(logp, ref, mask, estimator, clamp) >= 0).all()


def test_clamp_bounds_every_estimator_and_none_disables_it():
    assert _one(20.0, "k1") == 10.0 and _one(-20.0, "k1") == -10.0
    assert _one(20.0, "k2") == 10.0
    assert _one(-20.0, "k3") == 10.0
    assert _one(20.0, "k1", clamp=None) == pytest.approx(20.0)
    assert _one(-3.0, "k3", clamp=1.0) == 1.0
    assert _one(-3.0, "k3", clamp=None) == pytest.approx(math.exp(3.0) - 1 - 3.0, rel=1e-6)


def test_k3_far_below_the_reference_is_clamped_with_a_finite_zero_gradient():
    # exp(200) overflows float32: the clamped value must not come with a NaN gradient.
    logp = torch.tensor([-201.0, -1.5], requires_grad=True)
    ref = torch.tensor([-1.0, -1.0])
    k = kl_estimate(logp, ref, torch.tensor([True, True]), "k3")
    k.sum().backward()
    assert k[0].item() == 10.0
    assert torch.isfinite(logp.grad).all() and logp.grad[0] == 0
    # d = −0.5 below the clamp: dk3/dlogp = 1 − exp(−d).
    assert logp.grad[1].item() == pytest.approx(1 - math.exp(0.5))


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_masked_garbage_gives_zeros_and_no_nan(estimator):
    logp = torch.tensor([-0.5, math.nan, -math.inf, -1.0], requires_grad=True)
    ref = torch.tensor([-0.7, -math.inf, math.nan, math.inf])
    mask = torch.tensor([True, False, False, False])
    k = kl_estimate(logp, ref, mask, estimator)
    k.sum().backward()
    assert torch.isfinite(k).all() and k[1:].eq(0).all()
    assert torch.isfinite(logp.grad).all() and logp.grad[1:].eq(0).all()


def test_k1_gradient_is_one_per_valid_token():
    logp = torch.tensor([[-0.5, -2.0, -0.1], [-1.0, -3.0, -0.2]], requires_grad=True)
    ref = torch.tensor([[-0.6, -1.0, -0.3], [-1.5, -0.5, -0.2]])
    mask = torch.tensor([[True, True, False], [True, False, True]])
    kl_estimate(logp, ref, mask, "k1").sum().backward()
    assert torch.equal(logp.grad, mask.float())
    assert kl_estimate(logp, ref, mask, "k1").requires_grad


def test_k3_estimate_agrees_with_kl_k3():
    logp = torch.tensor([-0.5, -2.0, -0.1, -4.0])
    ref = torch.tensor([-0.6, -1.0, -0.3, -0.2])
    mask = torch.tensor([True, True, True, False])
    per_token = kl_estimate(logp, ref, mask, "k3")
    assert kl_k3(logp, ref, mask, 3).item() == pytest.approx(per_token.sum().item() / 3)


def test_bad_estimator_and_clamp_are_rejected():
    x, m = torch.zeros(2), torch.ones(2, dtype=torch.bool)
    with pytest.raises(ValueError, match="k1.*k2.*k3"):
        kl_estimate(x, x, m, "k4")
    with pytest.raises(ValueError, match="clamp"):
        kl_estimate(x, x, m, "k1", clamp=0.0)


# ---------------------------------------------------------------- coefficient controllers

@settings(max_examples=50, deadline=None)
@given(st.floats(0.0, 10.0), st.integers(0, 64), st.integers(1, 1000), st.floats(0.01, 1.0))
def test_adaptive_coef_moves_toward_the_target_by_at_most_a_fifth_per_horizon(kl, n, horizon, target):
    ctl = AdaptiveKLController(coef=0.1, target=target, horizon=horizon)
    new = ctl.update(kl, n)
    step = 0.2 * n / horizon
    assert new == ctl.coef
    assert max(0.0, 1 - step) * 0.1 - 1e-12 <= new <= (1 + step) * 0.1 + 1e-12
    if kl > target:
        assert new >= 0.1
    elif kl < target:
        assert new <= 0.1


def test_adaptive_coef_hand_values():
    ctl = AdaptiveKLController(coef=0.1, target=0.05, horizon=100)
    # KL far above target: the error is clipped to +0.2.
    assert ctl.update(1.0, 10) == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))
    before = ctl.coef
    # KL 10% above target: err = 0.1.
    assert ctl.update(0.055, 50) == pytest.approx(before * (1 + 0.1 * 50 / 100))
    before = ctl.coef
    # KL zero: err clipped to −0.2.
    assert ctl.update(0.0, 100) == pytest.approx(before * (1 - 0.2))


def test_controller_state_round_trips():
    ctl = AdaptiveKLController(coef=0.1, target=0.05, horizon=100)
    ctl.update(1.0, 10)
    state = json.loads(json.dumps(ctl.state_dict()))
    fresh = AdaptiveKLController(coef=0.1, target=0.05, horizon=100)
    fresh.load_state_dict(state)
    assert fresh.coef == ctl.coef
    assert fresh.update(0.5, 7) == ctl.update(0.5, 7)


def test_fixed_controller_never_changes():
    ctl = FixedKLController(coef=0.03)
    assert ctl.update(100.0, 1000) == 0.03 and ctl.update(0.0, 1000) == 0.03
    other = FixedKLController(coef=0.5)
    other.load_state_dict(ctl.state_dict())
    assert other.coef == 0.03


def test_adaptive_controller_validates_its_settings():
    with pytest.raises(ValueError, match="target"):
        AdaptiveKLController(coef=0.1, target=0.0, horizon=10)
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(coef=0.1, target=0.1, horizon=0)


def test_the_config_picks_a_fixed_or_an_adaptive_beta():
    fixed = kl_controller(AlgorithmConfig(kl_coef=0.1))
    assert isinstance(fixed, FixedKLController) and fixed.coef == 0.1
    adaptive = kl_controller(AlgorithmConfig(kl_coef=0.1, kl_target=0.05, kl_horizon=100))
    assert isinstance(adaptive, AdaptiveKLController) and (adaptive.target, adaptive.horizon) == (0.05, 100)


def test_behaviour_kl_is_the_mean_over_valid_tokens_of_the_global_batch():
    behav = [np.array([-1.0, -1.0, -9.0], dtype=np.float32), np.array([-2.0], dtype=np.float32)]
    ref = [np.array([-1.5, -1.5, 0.0], dtype=np.float32), np.array([-2.5], dtype=np.float32)]
    masks = [np.array([True, True, False]), np.array([True])]
    # k1 = behav − ref = 0.5 on each of the 3 valid tokens; the masked token's −9 does not count.
    assert behaviour_kl(behav, ref, masks, "k1", None) == pytest.approx(0.5)
    # Another rank's [sum, tokens] = [3.5, 1] added by the all-reduce: (1.5 + 3.5) / 4.
    other = torch.tensor([3.5, 1.0], dtype=torch.float64)
    assert behaviour_kl(behav, ref, masks, "k1", None, all_reduce=lambda t: t + other) == pytest.approx(1.25)
    assert behaviour_kl([], [], [], "k3", 10.0) == 0.0  # no tokens: 0, not NaN
