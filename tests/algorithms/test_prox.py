import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_flow.algorithms.prox import loglinear_prox, prox_is_behav

logps = st.floats(min_value=-20.0, max_value=0.0, allow_nan=False)


def test_tokens_of_the_prox_version_get_behav_exactly():
    logp = torch.tensor([-0.31, -2.7, -0.05])
    behav = torch.tensor([-0.29, -2.9, -0.02])
    out = loglinear_prox(logp, behav, torch.tensor([7, 7, 7]), prox_version=7)
    assert torch.equal(out, behav)


def test_one_version_older_gives_the_log_space_midpoint():
    logp, behav = torch.tensor([-0.4]), torch.tensor([-1.2])
    out = loglinear_prox(logp, behav, torch.tensor([6]), prox_version=7)
    assert out.item() == pytest.approx((logp.item() + behav.item()) / 2)


def test_very_old_tokens_approach_the_current_policy():
    logp, behav = torch.tensor([-0.4]), torch.tensor([-1.2])
    prox = 1000
    out = loglinear_prox(logp, behav, torch.tensor([0]), prox_version=prox)
    alpha = prox / (prox + 1)
    assert out.item() == pytest.approx(behav.item() + alpha * (logp.item() - behav.item()))
    assert abs(out.item() - logp.item()) < abs(logp.item() - behav.item()) / prox


def test_unknown_and_newer_versions_fall_back_to_behav():
    logp = torch.tensor([-0.4, -0.9, -3.0])
    behav = torch.tensor([-1.2, -0.1, -2.0])
    out = loglinear_prox(logp, behav, torch.tensor([-1, -5, 9]), prox_version=7)
    assert torch.equal(out, behav)


def test_result_is_detached_and_padding_garbage_stays_out():
    logp = torch.tensor([-0.4, math.nan, -math.inf], requires_grad=True)
    behav = torch.tensor([-1.2, -0.3, -0.7])
    out = loglinear_prox(logp, behav, torch.tensor([3, -1, 4]), prox_version=4)
    assert not out.requires_grad
    assert torch.isfinite(out).all()
    assert torch.equal(out[1:], behav[1:])


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(logps, logps, st.integers(-2, 12)), min_size=1, max_size=10), st.integers(0, 10))
def test_the_approximation_lies_between_behav_and_the_current_policy(tokens, prox_version):
    logp = torch.tensor([t[0] for t in tokens], dtype=torch.float64)
    behav = torch.tensor([t[1] for t in tokens], dtype=torch.float64)
    versions = torch.tensor([t[2] for t in tokens])
    out = loglinear_prox(logp, behav, versions, prox_version)
    lo, hi = torch.minimum(logp, behav), torch.maximum(logp, behav)
    assert ((out >= lo - 1e-12) & (out <= hi + 1e-12)).all()
    for i, v in enumerate(versions.tolist()):
        if 0 <= v <= prox_version:
            alpha = (prox_version - v) / (prox_version + 1 - v)
            assert out[i].item() == pytest.approx(behav[i].item() + alpha * (logp[i].item() - behav[i].item()))
        else:
            assert out[i].item() == behav[i].item()


def test_prox_is_behav():
    versions = torch.tensor([[5, 5, 3], [5, 4, 5]])
    all_valid = torch.ones(2, 3, dtype=torch.bool)
    assert not prox_is_behav(versions, all_valid, prox_version=5)
    # The older tokens are masked (e.g. prompt or tool output): they do not count.
    mask = torch.tensor([[True, True, False], [True, False, True]])
    assert prox_is_behav(versions, mask, prox_version=5)
    assert not prox_is_behav(versions, mask, prox_version=4)
    assert prox_is_behav(torch.full((2, 2), 4), torch.ones(2, 2, dtype=torch.bool), prox_version=4)
