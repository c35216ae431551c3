"""Where a step's proximal policy for decoupled PPO comes from, and a cheaper one: interpolate
instead of recomputing π_prox."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from areal_flow.config.schema import AlgorithmConfig


def loglinear_prox(
    logprobs: torch.Tensor, behav_logprobs: torch.Tensor, versions: torch.Tensor, prox_version: int
) -> torch.Tensor:
    """Approximate log π_prox per token without a forward pass of the proximal policy (AReaL).

    logprobs: log π_θ (the policy being trained, version prox_version + 1); behav_logprobs: log π_behav;
    versions: the policy version that sampled each token (negative = unknown). All one shape.
    Treating log π as linear in the version between the behaviour policy (version v_t) and π_θ:

        α_t = clamp((prox_version − v_t) / (prox_version + 1 − v_t), 0, 1)   if 0 ≤ v_t ≤ prox_version
        α_t = 0                                                              otherwise
        log π_prox ≈ behav_t + α_t · (sg(logprobs_t) − behav_t)

    A token sampled by prox_version itself gets α = 0, i.e. exactly behav: that policy IS π_prox.
    One version older gives the midpoint in log space; very old tokens approach log π_θ. Unknown (or
    impossible, newer) versions fall back to behav, i.e. plain PPO's ratio for that token.
    Returns a detached tensor of logprobs' dtype.
    """
    for name, t in (("behav_logprobs", behav_logprobs), ("versions", versions)):
        if t.shape != logprobs.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, logprobs has {tuple(logprobs.shape)}")
    logp = logprobs.detach()
    behav = behav_logprobs.detach().to(logp.dtype)
    v = versions.to(torch.float64)
    known = (v >= 0) & (v < prox_version + 1)
    # Where the version is unknown the denominator may be 0; `known` keeps that out of α.
    alpha = torch.where(known, (prox_version - v) / (prox_version + 1 - v).clamp(min=1), torch.zeros_like(v))
    alpha = alpha.clamp(0.0, 1.0).to(logp.dtype)
    # α = 0 selects behav itself (not behav + 0·(logp − behav)), so padding garbage in logprobs there
    # cannot turn into NaN, and the equality is exact.
    return torch.where(alpha > 0, behav + alpha * (logp - behav), behav)


def prox_is_behav(versions: torch.Tensor, mask: torch.Tensor, prox_version: int) -> bool:
    """True when every valid token was sampled by prox_version: then π_prox = π_behav exactly and
    neither a forward pass nor an approximation is needed. Masked tokens do not count."""
    if versions.shape != mask.shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)}, versions has {tuple(versions.shape)}")
    return bool(((versions == prox_version) | ~mask.bool()).all())


def prox_source(algo: AlgorithmConfig, *, reads_prox: bool, all_current: bool, exact: bool = False) -> str | None:
    """Where this step's π_prox comes from (library.PROX_SOURCES); None: the train node reads no
    prox_logprobs (`reads_prox` false) or algorithm.decoupled is false, and the loss is naive PPO
    against π_behav. `exact` (training.zero_mismatch): always the prox node's forward, which is the
    point of the mode, shortcuts or not.

    The shortcuts are exact: an update of one optimizer step runs its every forward with the
    weights from before it, which are π_prox; tokens all sampled by those weights (`all_current`,
    which every trainer rank must agree on: the prox forward is collective) have π_behav = π_prox."""
    if not reads_prox or not algo.decoupled:
        return None
    if exact:
        return "data"
    if algo.prox_shortcut and algo.n_minibatches * algo.ppo_epochs == 1:
        return "current"
    if algo.prox_shortcut and all_current:
        return "behav"
    return "loglinear" if algo.prox_logp == "loglinear" else "data"
