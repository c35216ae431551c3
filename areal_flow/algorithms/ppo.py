"""The policy-loss family around decoupled PPO (AReaL, arXiv 2505.24298, eq. 5; docs/architecture.md, "Staleness").

One entry point, `decoupled_ppo_loss`, covers clipped PPO (with asymmetric and dual clipping), CISPO
(MiniMax-M1) and GSPO's sequence-level ratio, always with AReaL's behaviour weight π_prox/π_behav.
`aggregation_weight` gives the per-token weights and denominator shares of veRL's loss aggregations.

The objective, per valid token t, with the anchor d = π_prox if given else π_behav and sg() the
stop-gradient:

    r_t    = exp(logp_t - d_t)                                             importance_level="token"
    r_t    = exp(logp_t - sg(logp_t) + sg(log s_i)),
             log s_i = mean_{valid t in seq i} (logp_t - d_t)              importance_level="sequence" (GSPO)
    c(r)   = clip(r, 1 - eps_clip, 1 + eps_clip_high)
    pg_t   = max(-A_t * r_t, -A_t * c(r_t))                                kind="ppo"
    pg_t   = min(pg_t, c_clip * |A_t|)                                     with c_clip (dual clip)
    pg_t   = -sg(c(r_t)) * A_t * logp_t                                    kind="cispo"
    w_t    = K(exp(prox_t - behav_t))                                      (stop-gradient; 1 without prox)
    loss   = sum_{mask} token_weights_t * w_t * pg_t / n_valid_tokens

K is the off-policy correction `correction` (corrections.py: areal, tis, mis, icepop, m2po,
mismatch_mask, vtrace) with its bounds (`behav_weight_cap` C or β, `behav_weight_floor` α,
`correction_tau` τ; None: no such bound) at `correction_level` (token, or sequence for tis and mis).
With the defaults it is AReaL's decoupled objective, eq. 5 of arXiv 2505.24298, with the weight
uncapped (v0.3.0's default); the library passes the cap 5. Each part is a function below:
`importance_ratio`, `ppo_term`, `behav_clip_term`, `cispo_term`, corrections.apply (w_t, always
applied when prox is given), `aggregate` and `loss_stats`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from areal_flow.algorithms import corrections
from areal_flow.algorithms.diagnostics import (
    BEHAV_WEIGHT_BIN,
    behav_weight_bins,
    behav_weight_edges,
    staleness_bucket_sums,
)

Stats = dict[str, torch.Tensor]

LOSS_KINDS = ("ppo", "cispo")
IMPORTANCE_LEVELS = ("token", "sequence")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {name} {value!r}; expected one of {', '.join(map(repr, allowed))}")


def aggregation_weight(mode: str, n_valid_in_seq: int, norm_length: int | None = None) -> tuple[float, float]:
    """(token_weight, denominator_share) for each valid token of one sequence with `n_valid_in_seq` valid tokens.

    The global loss is  sum_t token_weight_t * loss_t / sum_t denominator_share_t,  both sums over the valid
    tokens of the whole minibatch (all micro-batches and ranks). Pass the token weights to
    `decoupled_ppo_loss(token_weights=...)` and the global sum of shares as its `n_valid_tokens`; since the
    weights are per sequence and the denominator is global, micro-batch losses add up to the full loss.
    With n = n_valid_in_seq and S the number of sequences that have a valid token:

        "token-mean"               (1, 1)                 sum of losses / number of valid tokens
        "seq-mean-token-mean"      (1/n, 1/n)             mean over sequences of each sequence's token mean
        "seq-mean-token-sum"       (1, 1/n)               mean over sequences of each sequence's token sum
        "seq-mean-token-sum-norm"  (1/norm_length, 1/n)   Dr. GRPO: token sum / norm_length, mean over sequences

    "seq-mean-token-sum-norm" divides by a constant `norm_length` (the generation budget) instead of each
    sequence's length, so long answers are not down-weighted per token. A sequence without valid tokens
    gets (0, 0): it adds nothing to either sum.
    """
    _check_choice("aggregation", mode, AGGREGATIONS)
    if mode == "seq-mean-token-sum-norm" and (norm_length is None or norm_length <= 0):
        raise ValueError(f"aggregation {mode!r} needs a positive norm_length, got {norm_length!r}")
    if n_valid_in_seq < 0:
        raise ValueError(f"n_valid_in_seq must be >= 0, got {n_valid_in_seq}")
    if n_valid_in_seq == 0:
        return 0.0, 0.0
    n = float(n_valid_in_seq)
    if mode == "token-mean":
        return 1.0, 1.0
    if mode == "seq-mean-token-mean":
        return 1.0 / n, 1.0 / n
    if mode == "seq-mean-token-sum":
        return 1.0, 1.0 / n
    return 1.0 / float(norm_length), 1.0 / n


def _sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, seq_ids: torch.Tensor) -> torch.Tensor:
    """Per token, log s_i = the mean of `log_ratio` over the valid tokens of the token's sequence (detached).

    A sequence is a maximal run of equal ids in row-major order. `log_ratio` must already be 0 at masked
    positions; a sequence with no valid token gets 0 (s = 1), which is harmless since none of its tokens count.
    """
    counts = corrections.sequence_sum(mask.to(log_ratio.dtype), seq_ids).clamp(min=1)
    return corrections.sequence_sum(log_ratio, seq_ids) / counts


class _Anchored(NamedTuple):
    """The loss's inputs with masked positions zeroed, in logprobs' dtype (all but `logp` detached)."""

    logp: torch.Tensor  # log π_θ, carries the gradient
    anchor: torch.Tensor  # log π_prox, or log π_behav without prox: the ratio's denominator
    adv: torch.Tensor
    token_weights: torch.Tensor  # the aggregation weight; 1 on valid tokens by default
    weight: torch.Tensor  # the behaviour weight π_prox/π_behav before its correction; 1 without prox
    log_weight: torch.Tensor  # log π_prox - log π_behav; 0 without prox
    zero: torch.Tensor


def decoupled_ppo_loss(
    logprobs: torch.Tensor, prox_logprobs: torch.Tensor | None, behav_logprobs: torch.Tensor,
    advantages: torch.Tensor, mask: torch.Tensor, *, eps_clip: float, eps_clip_high: float | None = None,
    c_clip: float | None = None, kind: str = "ppo", importance_level: str = "token",
    seq_ids: torch.Tensor | None = None, correction: str = "areal", behav_weight_cap: float | None = None,
    behav_weight_floor: float | None = None, correction_tau: float | None = None, correction_level: str = "token",
    token_weights: torch.Tensor | None = None, n_valid_tokens: float | None = None,
    entropy: torch.Tensor | None = None, staleness: torch.Tensor | None = None, clip_behav: bool = False,
    per_token: bool = False,
) -> tuple[torch.Tensor, Stats]:
    """Decoupled policy loss (PPO or CISPO, token- or sequence-level ratio), summed over valid tokens:
    the objective of the module's docstring.

    All tensors have one shape: packed [T] or padded [B, T]. `logprobs` (π_θ) carries the gradient;
    `prox_logprobs` (π_prox, the actor before this update), `behav_logprobs` (π_behav, the policy that
    sampled the token), `advantages` and `token_weights` (see `aggregation_weight`) are treated as
    constants. `mask` (bool) marks valid tokens; masked positions contribute nothing, to the loss or the
    gradient, even if their inputs are inf/NaN. `seq_ids` (int) says which sequence each token belongs
    to, for a sequence-level ratio or correction. `clip_behav` (kind="ppo", token level, with prox) adds
    naive PPO's clip of the whole ratio π_θ/π_behav as a third pessimistic term (`behav_clip_term`).

    Returns (loss, stats); with `per_token`, each token's term of the loss instead of their sum (0
    where masked), for inspection (`python -m areal_flow.replay --dump`). Stats are detached 0-d sums (or a max), so that callers add them over
    micro-batches and ranks (`loss_stats`); with `entropy` (the policy's per-token entropy) its sum over
    the valid tokens, reported only; with `staleness` (each token's versions behind π_prox, an int tensor
    of the same shape), the per-staleness sums of diagnostics.staleness_bucket_sums: the weights, capped
    tokens and gradient weight by age.
    """
    params = corrections.Params(low=behav_weight_floor, high=behav_weight_cap, tau=correction_tau,
                                levels=corrections.DEFAULTS[correction].levels if correction in corrections.DEFAULTS else ())
    _check_options(kind, importance_level, c_clip, seq_ids, correction, params, correction_level, clip_behav)
    _check_shapes(logprobs, behav_logprobs=behav_logprobs, advantages=advantages, mask=mask,
                  prox_logprobs=prox_logprobs, seq_ids=seq_ids, token_weights=token_weights, entropy=entropy)
    mask = mask.bool()
    x = _anchored(logprobs, prox_logprobs, behav_logprobs, advantages, token_weights, mask)
    ratio = importance_ratio(x.logp, x.anchor, mask, importance_level, seq_ids)
    high = eps_clip if eps_clip_high is None else eps_clip_high
    clipped_ratio = torch.clamp(ratio, 1.0 - eps_clip, 1.0 + high)
    pg, took_clip, dual = _policy_term(kind, x, ratio, clipped_ratio, mask, c_clip,
                                       (eps_clip, high) if clip_behav and prox_logprobs is not None else None)
    if prox_logprobs is None:
        applied_weight, capped = x.weight, torch.zeros_like(mask)
    else:
        applied_weight, capped = corrections.apply(correction, x.log_weight, mask, params, level=correction_level,
                                                   seq_ids=seq_ids)
    aggregated = aggregation_terms if per_token else aggregate
    loss = aggregated(pg, applied_weight, x.token_weights, mask, n_valid_tokens)
    floor, cap = corrections.weight_bounds(correction, params)
    stats = loss_stats(mask, ratio, x.weight, took_clip, dual, capped, entropy, edges=behav_weight_edges(cap, floor))
    if staleness is not None:
        _check_shapes(logprobs, staleness=staleness)
        # |∂pg_t/∂logp_t|: the (clipped, for CISPO) ratio times |A| where the token keeps a gradient.
        keeps = mask & ~took_clip & ~dual if kind == "ppo" else mask
        factor = ratio if kind == "ppo" else clipped_ratio
        grad = torch.where(keeps, x.adv.abs() * factor * applied_weight * x.token_weights, x.zero).detach()
        stats.update(staleness_bucket_sums(staleness, mask, x.weight, capped, grad))
    return loss, stats


def _policy_term(kind: str, x: _Anchored, ratio: torch.Tensor, clipped_ratio: torch.Tensor, mask: torch.Tensor,
                 c_clip: float | None, behav_clip: tuple[float, float] | None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pg_t, clipped, dual-clipped) of the loss `kind`; `behav_clip` (low, high): naive PPO's clip too."""
    if kind != "ppo":
        pg, took_clip = cispo_term(x.logp, x.adv, ratio, clipped_ratio, mask)
        return pg, took_clip, torch.zeros_like(mask)
    pg, took_clip, dual = ppo_term(x.adv, ratio, clipped_ratio, mask, c_clip)
    if behav_clip is not None:
        pg, took_clip = behav_clip_term(pg, took_clip, x.adv, ratio, x.weight, mask, *behav_clip)
    return pg, took_clip, dual


def _check_options(kind: str, importance_level: str, c_clip: float | None, seq_ids: torch.Tensor | None,
                   correction: str, params: corrections.Params, level: str, clip_behav: bool) -> None:
    _check_choice("kind", kind, LOSS_KINDS)
    _check_choice("importance_level", importance_level, IMPORTANCE_LEVELS)
    _check_choice("correction", correction, corrections.CORRECTIONS)
    if c_clip is not None:
        if kind == "cispo":
            raise ValueError("c_clip (dual clip) is not defined for kind='cispo'; leave it None")
        if c_clip <= 1:
            raise ValueError(f"c_clip must be > 1, got {c_clip}")
    if (importance_level == "sequence" or level == "sequence") and seq_ids is None:
        raise ValueError("a sequence-level ratio or correction needs seq_ids")
    if params.low is not None and params.high is not None and params.low > params.high:
        raise ValueError(f"behav_weight_floor ({params.low}) > behav_weight_cap ({params.high})")
    # every bound a correction reads is required, but AReaL's (no cap: v0.3.0; no floor: its default)
    for bound in () if correction == "areal" else corrections.DEFAULTS[correction].reads:
        if getattr(params, bound) is None:
            raise ValueError(f"correction {correction!r} needs {corrections.KEYS[bound]}")
    if clip_behav and kind == "cispo":
        raise ValueError("clip_behav clips PPO's ratio; kind='cispo' has no clipped branch")
    if clip_behav and importance_level == "sequence":
        raise ValueError("clip_behav is defined for the token-level ratio; GSPO's sequence ratio is not r·w")


def _check_shapes(logprobs: torch.Tensor, **others: torch.Tensor | None) -> None:
    for name, t in others.items():
        if t is not None and t.shape != logprobs.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, logprobs has {tuple(logprobs.shape)}")


def _anchored(logprobs: torch.Tensor, prox_logprobs: torch.Tensor | None, behav_logprobs: torch.Tensor,
              advantages: torch.Tensor, token_weights: torch.Tensor | None, mask: torch.Tensor) -> _Anchored:
    # Zero the masked positions first: torch.where alone would still let inf - inf = NaN from the
    # unselected branch poison the backward pass (0 * NaN = NaN).
    zero = torch.zeros_like(logprobs)
    logp = torch.where(mask, logprobs, zero)
    behav = torch.where(mask, behav_logprobs.detach().to(logp.dtype), zero)
    adv = torch.where(mask, advantages.detach().to(logp.dtype), zero)
    if token_weights is None:
        tok_w = mask.to(logp.dtype)
    else:
        tok_w = torch.where(mask, token_weights.detach().to(logp.dtype), zero)
    if prox_logprobs is None:
        return _Anchored(logp, behav, adv, tok_w, torch.ones_like(logp), zero, zero)
    anchor = torch.where(mask, prox_logprobs.detach().to(logp.dtype), zero)
    log_weight = anchor - behav
    return _Anchored(logp, anchor, adv, tok_w, torch.exp(log_weight), log_weight, zero)


def importance_ratio(logp: torch.Tensor, anchor: torch.Tensor, mask: torch.Tensor, importance_level: str,
                     seq_ids: torch.Tensor | None) -> torch.Tensor:
    """r_t = π_θ/anchor per token; both log-probabilities already 0 at masked positions.

    GSPO (arXiv 2507.18071, in the "GSPO-token" form that veRL and AReaL use): every token of sequence i
    has the value r_t = s_i, the geometric mean of its token ratios over its valid tokens, and the
    gradient s_i * ∇logp_t; clipping is per token but sees the sequence's ratio. `seq_ids` (int, the same
    shape) says which sequence each token belongs to: a sequence is a maximal run of equal ids in
    row-major order. Masked tokens do not enter the mean.
    """
    if importance_level == "token":
        return torch.exp(logp - anchor)
    # logp - sg(logp) is 0 in value and 1 in gradient: the value is s_i, the gradient s_i * ∇logp_t.
    return torch.exp(logp - logp.detach() + _sequence_log_ratio(logp - anchor, mask, seq_ids))


def ppo_term(adv: torch.Tensor, ratio: torch.Tensor, clipped_ratio: torch.Tensor, mask: torch.Tensor,
             c_clip: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pg_t, clipped, dual-clipped) of PPO's pessimistic clipped objective, per token.

    The gradient flows through exactly one branch; a clipped token has none. Dual clip (Ye et al.
    2020) bounds the loss of a token with A < 0 whose ratio exceeds c_clip > 1; such a token has no
    gradient either (A > 0 is never affected, since there pg_t < 0 < c_clip * A_t).
    """
    unclipped = -adv * ratio
    clipped = -adv * clipped_ratio
    # The pessimistic (larger) of the two losses; selecting with `where` instead of `maximum`
    # makes the gradient flow through exactly one branch.
    took_clip = mask & (clipped > unclipped)
    pg = torch.where(took_clip, clipped, unclipped)
    dual = torch.zeros_like(mask)
    if c_clip is not None:
        # Only A < 0 and r > c_clip can exceed the bound; the bound is a constant, so no gradient.
        bound = c_clip * adv.abs()
        dual = mask & (pg > bound)
        pg = torch.where(dual, bound, pg)
    return pg, took_clip, dual


def behav_clip_term(pg: torch.Tensor, took_clip: torch.Tensor, adv: torch.Tensor, ratio: torch.Tensor,
                    weight: torch.Tensor, mask: torch.Tensor, low: float, high: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(pg_t, clipped) with a third, pessimistic term: naive PPO's clip of the whole ratio
    π_θ/π_behav = r_t·w_t, divided by w_t so that the behaviour weight the loss multiplies by gives
    naive PPO's clipped objective back: pg_t = max(pg_t, -A_t·clip(r_t·w_t, 1 - low, 1 + high)/w_t).
    Where that clip is active the term is a constant (no gradient); where it is not, it equals
    -A_t·r_t and is never taken over pg_t. A token with w_t = 0 keeps pg_t.

    So a token the policy has moved past the clip since it was sampled, in its advantage's direction,
    gets no gradient, however many versions that took. It is not AReaL's objective: a first minibatch
    at π_θ = π_prox loses the gradient of every stale token past 1 ± ε. `decoupled_ppo_loss` refuses it
    with kind="cispo" (no clipped branch) and at sequence level (GSPO's ratio is not r·w)."""
    safe = torch.where(weight > 0, weight, torch.ones_like(weight))
    total = torch.clamp(ratio * safe, 1.0 - low, 1.0 + high) / safe
    behav_clipped = -adv * total
    took = mask & (weight > 0) & (behav_clipped > pg)
    return torch.where(took, behav_clipped, pg), took_clip | took


def cispo_term(logp: torch.Tensor, adv: torch.Tensor, ratio: torch.Tensor, clipped_ratio: torch.Tensor,
               mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(pg_t, clipped) of CISPO (MiniMax-M1, arXiv 2506.13585), per token.

    The clipped ratio is a constant importance weight on the REINFORCE term, so every valid token keeps
    the gradient -c(r_t) * A_t * w_t * ∇logp_t, even where PPO would clip it. Its loss value is not
    PPO's and only its gradient is meaningful. MiniMax sets eps_clip large, which in effect turns the
    lower bound off and keeps only the upper one. `c_clip` is refused with CISPO.
    """
    took_clip = mask & (clipped_ratio != ratio)
    return -clipped_ratio.detach() * adv * logp, took_clip


def aggregate(pg: torch.Tensor, weight: torch.Tensor, token_weights: torch.Tensor, mask: torch.Tensor,
              n_valid_tokens: float | None) -> torch.Tensor:
    """sum_{mask} token_weights_t * w_t * pg_t / n_valid_tokens.

    `token_weights` are per-token aggregation weights (`aggregation_weight`). `n_valid_tokens` is the
    denominator of the GLOBAL minibatch (all ranks and micro-batches), so that the micro-batch losses
    add up to the global loss; it defaults to sum_{mask} token_weights (>= 1), which is right for
    "token-mean" and "seq-mean-token-mean" on a whole minibatch.
    """
    per_token = torch.where(mask, token_weights * weight * pg, torch.zeros_like(pg))
    return per_token.sum() / _denominator(token_weights, n_valid_tokens, pg)


def aggregation_terms(pg: torch.Tensor, weight: torch.Tensor, token_weights: torch.Tensor, mask: torch.Tensor,
                      n_valid_tokens: float | None) -> torch.Tensor:
    """Each token's term of `aggregate` (0 where masked): they sum to it, up to rounding."""
    per_token = torch.where(mask, token_weights * weight * pg, torch.zeros_like(pg))
    return per_token / _denominator(token_weights, n_valid_tokens, pg)


def _denominator(token_weights: torch.Tensor, n_valid_tokens: float | None, like: torch.Tensor) -> torch.Tensor:
    if n_valid_tokens is None:
        return token_weights.sum().detach().clamp(min=1)
    return torch.as_tensor(max(float(n_valid_tokens), 1.0), dtype=like.dtype, device=like.device)


def loss_stats(mask: torch.Tensor, ratio: torch.Tensor, weight: torch.Tensor, took_clip: torch.Tensor,
               dual: torch.Tensor, capped: torch.Tensor, entropy: torch.Tensor | None, *,
               edges: list[float] | None = None) -> Stats:
    """The loss's detached 0-d statistics over the valid tokens: n_tokens, clipped_tokens (PPO: the
    clipped branch was taken, no gradient; CISPO: the weight c(r_t) differs from r_t, the gradient
    stays), dual_clipped_tokens, capped_tokens (the tokens whose w_t the correction masked or
    truncated), ratio_sum (of r_t), behav_weight_sum and behav_weight_max (of w_t before the
    correction), entropy_sum with `entropy` (divide by n_tokens for the mean). And for the step's
    diagnostics (algorithms/diagnostics.py): behav_weight_sq_sum (Σw², for the effective sample size)
    and the histogram of w_t over `edges` (default: behav_weight_edges(None)), one count per bin under
    diagnostics.BEHAV_WEIGHT_BIN, all before the cap and floor."""
    zero = torch.zeros_like(ratio)
    dtype = ratio.dtype
    masked_weight = torch.where(mask, weight, zero).detach()
    stats: Stats = {
        "n_tokens": mask.sum().detach().to(dtype),
        "clipped_tokens": took_clip.sum().detach().to(dtype),
        "dual_clipped_tokens": dual.sum().detach().to(dtype),
        "capped_tokens": capped.sum().detach().to(dtype),
        "ratio_sum": torch.where(mask, ratio, zero).sum().detach(),
        "behav_weight_sum": masked_weight.sum(),
        # w >= 0, so 0 is a neutral element for an empty micro-batch.
        "behav_weight_max": masked_weight.max() if masked_weight.numel() else zero.sum().detach(),
        "behav_weight_sq_sum": (masked_weight * masked_weight).sum(),
    }
    bins = behav_weight_bins(weight, mask, behav_weight_edges(None) if edges is None else edges)
    stats.update({BEHAV_WEIGHT_BIN.format(i): count for i, count in enumerate(bins.unbind())})
    if entropy is not None:
        stats["entropy_sum"] = torch.where(mask, entropy.detach().to(dtype), zero).sum()
    return stats
