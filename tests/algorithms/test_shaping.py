import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_flow.algorithms.shaping import overlong_penalty


def test_hand_values():
    max_new, overlong, factor = 100, 20, 2.0
    lengths = torch.tensor([10, max_new - overlong, max_new - overlong // 2, max_new])
    out = overlong_penalty(lengths, max_new_tokens=max_new, overlong_tokens=overlong, factor=factor)
    assert out.dtype.is_floating_point
    assert out.tolist() == pytest.approx([0.0, 0.0, -factor / 2, -factor])


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 4096), st.data(), st.floats(0.0, 5.0))
def test_zero_before_the_window_then_linear_down_to_minus_factor(max_new, data, factor):
    overlong = data.draw(st.integers(1, max_new))
    lengths = torch.arange(0, max_new + 1)
    out = overlong_penalty(lengths, max_new_tokens=max_new, overlong_tokens=overlong, factor=factor)
    start = max_new - overlong
    assert out[: start + 1].eq(0).all()
    assert out[-1].item() == pytest.approx(-factor)
    assert (out[1:] <= out[:-1]).all()  # never rewards being longer
    slope = -factor / overlong
    assert torch.allclose(out[start:], slope * (lengths[start:] - start).double().to(out.dtype), atol=1e-5)


def test_validation():
    for overlong, max_new in ((0, 10), (11, 10), (-1, 10)):
        with pytest.raises(ValueError, match="overlong_tokens"):
            overlong_penalty(torch.tensor([5]), max_new_tokens=max_new, overlong_tokens=overlong)
