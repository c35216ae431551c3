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
