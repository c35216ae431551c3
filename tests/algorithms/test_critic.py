import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_flow.algorithms.critic import value_loss


def test_mse_is_half_the_squared_error_when_nothing_clips():
    v = torch.tensor([1.0, 2.0, 0.5], requires_grad=True)
    old, ret = v.detach().clone(), torch.tensor([0.0, 4.0, 0.5])
    loss, stats = value_loss(v, old, ret, torch.ones(3, dtype=torch.bool), value_clip=0.2)
    assert loss.item() == pytest.approx((0.5 * 1 + 0.5 * 4 + 0) / 3)
    (g,) = torch.autograd.grad(loss, v)
    assert g.tolist() == pytest.approx([1 / 3, -2 / 3, 0.0])
    assert stats["value_clipped_tokens"].item() == 0 and stats["value_error_sum"].item() == pytest.approx(3.0)


def test_a_value_that_moved_past_the_clip_away_from_the_return_gets_no_gradient():
    # old 0, return 1: v = -0.5 moved away (clipped -0.2 is closer to the return: the plain loss is
    # the worse one, kept with its gradient); v = 1.5 overshot past the return, clipped 0.2 is the
    # worse one: kept, and no gradient flows.
    v = torch.tensor([-0.5, 1.5], requires_grad=True)
    loss, stats = value_loss(v, torch.zeros(2), torch.ones(2), torch.ones(2, dtype=torch.bool), value_clip=0.2)
    assert loss.item() == pytest.approx((0.5 * 1.5**2 + 0.5 * 0.8**2) / 2)
    (g,) = torch.autograd.grad(loss, v)
    assert g.tolist() == pytest.approx([-1.5 / 2, 0.0])
    assert stats["value_clipped_tokens"].item() == 1


def test_huber_is_linear_beyond_delta():
    v = torch.tensor([13.0], requires_grad=True)
    loss, _ = value_loss(v, v.detach(), torch.zeros(1), torch.ones(1, dtype=torch.bool), value_clip=None,
                         kind="huber", huber_delta=10.0)
    assert loss.item() == pytest.approx(10.0 * (13.0 - 0.5 * 10.0))
    (g,) = torch.autograd.grad(loss, v)
    assert g.item() == pytest.approx(10.0)


def test_bad_arguments_are_refused():
    one = torch.zeros(2)
    with pytest.raises(ValueError, match="must be one of mse, huber"):
        value_loss(one, one, one, one.bool(), kind="l1")
    with pytest.raises(ValueError, match="value_clip must be > 0"):
        value_loss(one, one, one, one.bool(), value_clip=0.0)
    with pytest.raises(ValueError, match="returns has shape"):
        value_loss(one, one, torch.zeros(3), one.bool())


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.floats(-5, 5), st.floats(-5, 5), st.floats(-5, 5), st.booleans()), min_size=1, max_size=8),
       st.sampled_from(["mse", "huber"]), st.sampled_from([None, 0.2, 1.0]))
def test_masked_tokens_change_nothing_and_an_all_masked_batch_gives_zero(rows, kind, clip):
    v = torch.tensor([r[0] for r in rows], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([r[1] for r in rows], dtype=torch.float64)
    ret = torch.tensor([r[2] for r in rows], dtype=torch.float64)
    mask = torch.tensor([r[3] for r in rows])
    loss, _ = value_loss(v, old, ret, mask, value_clip=clip, kind=kind)
    (g,) = torch.autograd.grad(loss, v)
    garbage = torch.where(mask, ret, torch.tensor(float("nan"), dtype=torch.float64))
    v2 = torch.where(mask, v.detach(), torch.tensor(float("inf"), dtype=torch.float64)).requires_grad_()
    loss2, _ = value_loss(v2, torch.where(mask, old, garbage), garbage, mask, value_clip=clip, kind=kind)
    (g2,) = torch.autograd.grad(loss2, v2)
    assert torch.isfinite(loss2) and loss2.item() == pytest.approx(loss.item())
    assert torch.allclose(g2[mask], g[mask]) and not g2[~mask].any()
    if not mask.any():
        assert loss.item() == 0.0
