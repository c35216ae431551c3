"""KL penalty to a reference policy, per token."""

from __future__ import annotations

import torch


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, n_valid_tokens: float) -> torch.Tensor:
    """Schulman's k3 estimator of KL(π‖π_ref), summed over valid tokens / n_valid_tokens.

    Shapes: all [T] (or all [B, T]); mask bool. k3 = exp(ref − logp) − 1 − (ref − logp) ≥ 0,
    unbiased, and its gradient pulls π toward π_ref; clamped to 10 as AReaL does.
    """
    d = torch.where(mask, ref_logprobs - logprobs, torch.zeros_like(logprobs))
    k3 = (torch.exp(d) - 1 - d).clamp(max=10.0)
    return (k3 * mask).sum() / max(float(n_valid_tokens), 1.0)
