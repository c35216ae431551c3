"""The decoupled PPO objective (AReaL, arXiv 2505.24298, eq. 5; docs/architecture.md, "Staleness")."""

from __future__ import annotations

import torch

Stats = dict[str, torch.Tensor]


def decoupled_ppo_loss(
    logprobs: torch.Tensor,
    prox_logprobs: torch.Tensor | None,
    behav_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_clip: float,
    eps_clip_high: float | None = None,
    behav_weight_cap: float | None = None,
    n_valid_tokens: float | None = None,
) -> tuple[torch.Tensor, Stats]:
    """Token-level decoupled PPO loss, summed over valid tokens and divided by `n_valid_tokens`.

    All tensors have one shape: packed [T] or padded [B, T]. `logprobs` (π_θ) carries the gradient;
    `prox_logprobs` (π_prox, the actor before this update), `behav_logprobs` (π_behav, the policy that
    sampled the token) and `advantages` are treated as constants. `mask` (bool) marks valid tokens.

        r_t    = exp(logp_t - prox_t)
        w_t    = exp(prox_t - behav_t)                       (stop-gradient, always applied)
        loss_t = -w_t * min(r_t * A_t, clip(r_t, 1 - eps_clip, 1 + eps_clip_high) * A_t)
        loss   = sum_{mask} loss_t / n_valid_tokens

    `eps_clip_high` defaults to `eps_clip`. With `behav_weight_cap`, tokens whose w_t exceeds the cap
    get w_t = 0 but still count in the denominator, so dropping them never inflates the others.
    `n_valid_tokens` is the valid-token count of the GLOBAL minibatch (all ranks and micro-batches),
    so that the micro-batch losses add up to the global token mean; it defaults to mask.sum() (>= 1).
    `prox_logprobs=None` is plain PPO against π_behav: r_t = exp(logp_t - behav_t), w_t = 1, no cap.

    Masked positions contribute nothing, to the loss or the gradient, even if their inputs are inf/NaN.

    Returns (loss, stats). Stats are detached 0-d sums (or a max), so that callers add them over
    micro-batches and ranks: n_tokens, clipped_tokens (the clipped branch was taken, no gradient),
    capped_tokens, ratio_sum (of r_t), behav_weight_sum and behav_weight_max (of w_t before the cap).
    """
    shape = logprobs.shape
    others = {"behav_logprobs": behav_logprobs, "advantages": advantages, "mask": mask}
    if prox_logprobs is not None:
        others["prox_logprobs"] = prox_logprobs
    for name, t in others.items():
        if t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, logprobs has {tuple(shape)}")
    if eps_clip_high is None:
        eps_clip_high = eps_clip
    mask = mask.bool()

    # Zero the masked positions first: torch.where alone would still let inf - inf = NaN from the
    # unselected branch poison the backward pass (0 * NaN = NaN).
    zero = torch.zeros_like(logprobs)
    logp = torch.where(mask, logprobs, zero)
    behav = torch.where(mask, behav_logprobs.detach().to(logp.dtype), zero)
    adv = torch.where(mask, advantages.detach().to(logp.dtype), zero)
    if prox_logprobs is None:
        anchor = behav
        weight = torch.ones_like(logp)
    else:
        anchor = torch.where(mask, prox_logprobs.detach().to(logp.dtype), zero)
        weight = torch.exp(anchor - behav)

    ratio = torch.exp(logp - anchor)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_clip_high)
    # The pessimistic (larger) of the two losses; selecting with `where` instead of `maximum`
    # makes the gradient flow through exactly one branch.
    took_clip = mask & (clipped > unclipped)
    pg = torch.where(took_clip, clipped, unclipped)

    if prox_logprobs is not None and behav_weight_cap is not None:
        capped = mask & (weight > behav_weight_cap)
    else:
        capped = torch.zeros_like(mask)
    applied_weight = torch.where(capped, zero, weight)

    per_token = torch.where(mask, pg * applied_weight, zero)
    if n_valid_tokens is None:
        denom = mask.sum().clamp(min=1).to(logp.dtype)
    else:
        denom = torch.as_tensor(max(float(n_valid_tokens), 1.0), dtype=logp.dtype)
    loss = per_token.sum() / denom

    masked_weight = torch.where(mask, weight, zero).detach()
    stats: Stats = {
        "n_tokens": mask.sum().detach().to(logp.dtype),
        "clipped_tokens": took_clip.sum().detach().to(logp.dtype),
        "capped_tokens": capped.sum().detach().to(logp.dtype),
        "ratio_sum": torch.where(mask, ratio, zero).sum().detach(),
        "behav_weight_sum": masked_weight.sum(),
        # w >= 0, so 0 is a neutral element for an empty micro-batch.
        "behav_weight_max": masked_weight.max() if masked_weight.numel() else zero.sum().detach(),
    }
    return loss, stats
