"""The off-policy corrections of the behaviour weight w_t = π_prox/π_behav (docs/algorithms.md,
"Off-policy corrections").

The decoupled objective (AReaL, arXiv 2505.24298, eq. 5) multiplies each token's PPO term by w_t,
the ratio between the policy the step starts from and the one that sampled the token. Each function
here bounds or masks that weight in one published way. All take the per-token log weight
`log_w` = log π_prox − log π_behav and the valid-token `mask` (one shape, packed [T] or padded
[B, T]), and return (the applied weight, the valid tokens whose weight the correction changed:
masked to 0 or truncated). Pure functions on detached tensors; no host synchronisation.

    areal          w·1[low ≤ w ≤ high]                          AReaL's behav_imp_weight_cap (high 5)
    tis            min(w, C)            per token                truncated IS (Yao et al. 2025, C = 2)
                   min(ρ_i, C)          ρ_i = Π_{t∈i} w_t        sequence level
    mis            w·1[w ≤ C]           per token                masked IS (C = 2)
                   ρ_i·1[ρ_i ≤ C]                                sequence level: the whole answer
    icepop         w·1[α ≤ w ≤ β]                                IcePop (Ring-1T, arXiv 2510.18855; [0.5, 5])
    m2po           w·1[t kept]          mean_kept((log w)²) ≤ τ  M2PO (arXiv 2510.01161; τ = 0.04)
    mismatch_mask  w·1[|log w| ≤ τ]                              a mask on the train/inference mismatch
    vtrace         min(ρ̄, w)                                     V-trace's ρ̄ (IMPALA, arXiv 1802.01561; ρ̄ = 1)

A sequence is a maximal run of equal `seq_ids` in row-major order (as ppo.importance_ratio's).
"""

from __future__ import annotations

import torch

from areal_flow.algorithms.correction_table import (CORRECTIONS, DEFAULTS, KEYS, Params, configured, resolve,
                                                    weight_bounds)

__all__ = ["CORRECTIONS", "DEFAULTS", "KEYS", "Params", "configured", "resolve", "weight_bounds"]


def areal(log_w: torch.Tensor, mask: torch.Tensor, *, high: float | None, low: float | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """AReaL's capped behaviour weight: w outside [low, high] is masked to 0; the token stays in the
    loss's denominator (dropping it never inflates the others)."""
    w = torch.exp(log_w)
    outside = _outside(w, mask, low, high)
    return torch.where(outside, torch.zeros_like(w), w), outside


def icepop(log_w: torch.Tensor, mask: torch.Tensor, *, low: float, high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """IcePop's two-sided mask: w·1[low ≤ w ≤ high] (α = 0.5, β = 5 in Ring-1T)."""
    return areal(log_w, mask, high=high, low=low)


def truncated_is(log_w: torch.Tensor, mask: torch.Tensor, *, high: float, level: str = "token",
                 seq_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated importance sampling: min(w_t, C) per token, or min(ρ_i, C) on every token of answer
    i with ρ_i = Π_t w_t its sequence ratio. The truncated tokens keep a (smaller) gradient."""
    w = _level_weight(log_w, mask, level, seq_ids)
    truncated = mask & (w > high)
    return torch.clamp(w, max=high), truncated


def masked_is(log_w: torch.Tensor, mask: torch.Tensor, *, high: float, level: str = "token",
              seq_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked importance sampling: w_t·1[w_t ≤ C] per token, or ρ_i·1[ρ_i ≤ C] on every token of
    answer i (an answer whose sequence ratio exceeds C is dropped whole)."""
    w = _level_weight(log_w, mask, level, seq_ids)
    outside = mask & (w > high)
    return torch.where(outside, torch.zeros_like(w), w), outside


def m2po(log_w: torch.Tensor, mask: torch.Tensor, *, tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """M2PO's second-moment mask: w·1[t kept], keeping the valid tokens such that mean((log w)²)
    over them is at most τ, found by dropping the tokens of largest (log w)² first (`m2_keep`)."""
    dropped = mask & ~m2_keep(log_w, mask, tau)
    w = torch.exp(log_w)
    return torch.where(dropped, torch.zeros_like(w), w), dropped


def mismatch_mask(log_w: torch.Tensor, mask: torch.Tensor, *, tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A mask on the mismatch between the trainer's and the sampler's log-probabilities:
    w·1[|log π_prox − log π_behav| ≤ τ]. (prime-rl's IPO loss masks on the probability
    difference |π_train − π_infer| > ε instead.)"""
    w = torch.exp(log_w)
    outside = mask & (log_w.abs() > tau)
    return torch.where(outside, torch.zeros_like(w), w), outside


def vtrace(log_w: torch.Tensor, mask: torch.Tensor, *, high: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """V-trace's truncated weight ρ_t = min(ρ̄, w_t) (IMPALA; ρ̄ = 1: a stale token is weighted down,
    never up)."""
    return truncated_is(log_w, mask, high=high)


def apply(name: str, log_w: torch.Tensor, mask: torch.Tensor, params: Params, *, level: str = "token",
          seq_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The correction `name` with its resolved `params` (see `resolve`): (applied weight, changed)."""
    if level not in params.levels:
        raise ValueError(f"correction {name!r} is defined at level {' or '.join(params.levels)}, not {level!r}")
    if level == "sequence" and seq_ids is None:
        raise ValueError("a sequence-level correction needs seq_ids")
    if name == "areal":
        return areal(log_w, mask, high=params.high, low=params.low)
    if name == "icepop":
        return icepop(log_w, mask, low=params.low, high=params.high)
    if name == "tis":
        return truncated_is(log_w, mask, high=params.high, level=level, seq_ids=seq_ids)
    if name == "mis":
        return masked_is(log_w, mask, high=params.high, level=level, seq_ids=seq_ids)
    if name == "m2po":
        return m2po(log_w, mask, tau=params.tau)
    if name == "mismatch_mask":
        return mismatch_mask(log_w, mask, tau=params.tau)
    if name == "vtrace":
        return vtrace(log_w, mask, high=params.high)
    raise ValueError(f"unknown correction {name!r}; expected one of {', '.join(map(repr, CORRECTIONS))}")


def _outside(w: torch.Tensor, mask: torch.Tensor, low: float | None, high: float | None) -> torch.Tensor:
    outside = torch.zeros_like(mask)
    if high is not None:
        outside = outside | (w > high)
    if low is not None:
        outside = outside | (w < low)
    return mask & outside


def _level_weight(log_w: torch.Tensor, mask: torch.Tensor, level: str, seq_ids: torch.Tensor | None) -> torch.Tensor:
    """w_t per token, or each token's sequence ratio ρ_i = exp(Σ_{valid t ∈ i} log w_t)."""
    if level == "token":
        return torch.exp(log_w)
    return torch.exp(sequence_sum(torch.where(mask, log_w, torch.zeros_like(log_w)), seq_ids))


def sequence_sum(x: torch.Tensor, seq_ids: torch.Tensor) -> torch.Tensor:
    """Per token, the sum of `x` (detached) over the token's sequence: a maximal run of equal
    `seq_ids` in row-major order."""
    runs, inverse = torch.unique_consecutive(seq_ids.reshape(-1), return_inverse=True)
    flat = x.detach().reshape(-1)
    sums = flat.new_zeros(runs.numel()).index_add_(0, inverse, flat)
    return sums[inverse].reshape(x.shape)


def m2_keep(log_weight: torch.Tensor, mask: torch.Tensor, tau: float) -> torch.Tensor:
    """M2PO's token mask (Zheng et al. 2025, "Prosperity before Collapse", arXiv 2510.01161): the
    valid tokens to keep so that the second moment of their log weights, mean((log w)²), is at most
    `tau`, found by dropping the tokens of largest (log w)² first; the fewest such drops. Invalid
    tokens are not counted, and are returned False. On the device without a host synchronisation.
    Applied per micro-batch here (the paper: per batch)."""
    if tau < 0:
        raise ValueError(f"M2PO's tau must be >= 0, got {tau}")
    sq = torch.where(mask, log_weight.detach().float() ** 2, torch.zeros_like(log_weight, dtype=torch.float32))
    flat = sq.reshape(-1)
    if flat.numel() == 0:
        return mask.clone()
    s = torch.sort(flat, descending=True).values  # the invalid tokens' 0s sort last
    n = mask.sum().to(torch.float32)
    j = torch.arange(flat.numel() + 1, device=flat.device, dtype=torch.float32)  # tokens dropped
    kept_sum = flat.sum() - torch.cat([s.new_zeros(1), torch.cumsum(s, 0)])
    fits = kept_sum <= tau * (n - j).clamp(min=0) + 1e-12
    first = torch.argmax(fits.to(torch.int8))  # the fewest drops that fit (j = n always fits)
    threshold = torch.cat([s, s.new_full((1,), -1.0)])[first]  # the largest (log w)² kept
    return mask & (sq <= threshold)
