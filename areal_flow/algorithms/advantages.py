"""Group-relative advantages (GRPO and Dr.GRPO)."""

from __future__ import annotations

import torch


def group_normalized_advantages(
    rewards: torch.Tensor, group_size: int, eps: float = 1e-6, scale_by_std: bool = True
) -> torch.Tensor:
    """Advantage of each sample relative to the other answers to the same prompt.

    rewards: [N], the answers of one prompt in contiguous blocks of `group_size` (N % group_size == 0).
    Returns [N] float: A = (r - mean_group) / (std_group + eps), with the unbiased std.

    A group whose rewards are all equal carries no signal and gets zeros (the numerator is exactly 0),
    and so does group_size 1, where there is nothing to compare with. `scale_by_std=False` gives
    A = r - mean_group (Dr.GRPO), which does not up-weight groups that are nearly all right or wrong.
    """
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"the number of rewards ({rewards.numel()}) is not divisible by group_size ({group_size})"
        )
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    groups = rewards.reshape(-1, group_size)
    centered = groups - groups.mean(dim=1, keepdim=True)
    if not scale_by_std or group_size == 1:
        # With one sample per group `centered` is already 0; the unbiased std would be NaN.
        return centered.reshape(-1)
    std = groups.std(dim=1, unbiased=True, keepdim=True)
    return (centered / (std + eps)).reshape(-1)
