"""Reward shaping that depends on the answer, not on its correctness."""

from __future__ import annotations

import torch


def overlong_penalty(
    lengths: torch.Tensor, *, max_new_tokens: int, overlong_tokens: int, factor: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), added to the reward.

    lengths: [N] output lengths. With L = max_new_tokens and C = overlong_tokens:

        penalty = clip(−(len − (L − C)) / C · factor, −factor, 0)

    0 up to L − C tokens, then linear down to −factor at the limit L (and −factor beyond it, as in the
    paper). A long answer is punished gradually rather than cut to a flat 0 reward, which would punish
    a right answer that merely ran long as hard as a wrong one. Returns [N] float.
    """
    if not 0 < overlong_tokens <= max_new_tokens:
        raise ValueError(
            f"need 0 < overlong_tokens <= max_new_tokens, got overlong_tokens={overlong_tokens}, "
            f"max_new_tokens={max_new_tokens}"
        )
    if factor < 0:
        raise ValueError(f"factor must be >= 0, got {factor}")
    if not lengths.is_floating_point():
        lengths = lengths.to(torch.get_default_dtype())
    excess = lengths - (max_new_tokens - overlong_tokens)
    return (-excess / overlong_tokens * factor).clamp(min=-factor, max=0.0)
