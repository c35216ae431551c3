"""Per-step diagnostics of a train batch: length bias (Dr. GRPO) and the behaviour weight's spread.

Pure functions on arrays and tensors, no I/O. Everything the trainer computes here is a sum or a
count, so that micro-batches, minibatches and trainer ranks add them up (training/step_stats.py
`accumulate_stats`, the worker's all-reduce) and the controller forms the ratios and lists of a
step's metrics row (controller/run_metrics.py `train_metrics`). This module imports no torch at
module level: the controller reads its key names and histogram edges without it.

Length buckets: the four quarters of the generation budget `max_new_tokens`, by answer length L:
q1 is L <= 25% of it, q2 25% < L <= 50%, q3 50% < L <= 75%, q4 L > 75% (truncated answers are in q4).

Per bucket the trainer sums (`length_bucket_sums`):

    by_length/adv_sum/qK      Σ over the bucket's answers with a valid token of the answer's mean
                              advantage over its valid tokens (per sequence: each answer counts once)
    by_length/adv_seqs/qK     the number of those answers
    by_length/loss_weight/qK  Σ over the bucket's valid tokens of |A_t| · token_weight_t

`token_weight_t` is the token's weight in the loss's numerator under the configured aggregation
(ppo.aggregation_weight: 1 under token-mean and seq-mean-token-sum, 1/n under
seq-mean-token-mean, 1/norm_length under Dr. GRPO's seq-mean-token-sum-norm). The loss's
denominator is one global number (Σ of LOSS_SHARE_KEY shares, or the valid-token count), the same
for every token, so it cancels in a share: a bucket's loss share, loss_weight_qK / Σ_K
loss_weight_qK, is its share of the advantage-weighted gradient weight of the step, before the
importance and behaviour weights. Under token-mean long answers carry a share growing with their
length; under seq-mean-token-mean every answer carries the same weight whatever its length.

The behaviour weight w_t = π_prox/π_behav (before its cap and floor) per valid token: a histogram
over `behav_weight_edges(cap, floor)` (`behav_weight_bins`, one count per bin under BEHAV_WEIGHT_BIN) and
the effective sample size `ess_fraction` from Σw, Σw² and N.

By staleness: a token sampled d versions before the weights its step started from (d = the step's
π_prox version − the token's version) falls in one of STALENESS_BUCKETS (0, 1, 2, 3-4, 5-8, 9+).
Per bucket the loss sums (`staleness_bucket_sums`, keys STALE.format(bucket, what)):

    tokens      the valid tokens
    weight_sum  Σ w_t (before the cap and floor; 1 per token without π_prox)
    weight_max  the largest w_t
    capped      the tokens whose w_t is outside [floor, cap] (masked or clamped)
    grad        Σ |∂loss/∂log π_θ(t)| × the denominator: |A_t|·ratio_t·w_t·token_weight_t over the
                tokens that keep a gradient (PPO: not clipped; CISPO: every valid one, with its
                clipped ratio): the bucket's weight in the step's gradient, before ∇log π itself

and the trainer adds, per step, the share of `grad` from the step's stalest bucket in each
minibatch (`stalest_share`): the largest, and the last minibatch's, which trains furthest from
π_prox.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

LENGTH_BUCKETS = ("q1", "q2", "q3", "q4")
"""The quarters of max_new_tokens, shortest first."""

ADV_SUM, ADV_SEQS, LOSS_WEIGHT = "by_length/adv_sum/{}", "by_length/adv_seqs/{}", "by_length/loss_weight/{}"
"""The trainer's per-bucket sums (formatted with a LENGTH_BUCKETS name)."""

STALENESS_BUCKETS = ("0", "1", "2", "3-4", "5-8", "9+")
"""Versions behind the step's π_prox, grouped: each bucket's lowest value is _STALENESS_LOW's."""
_STALENESS_LOW = (0, 1, 2, 3, 5, 9)
STALE = "stale/{}/{}"
"""The loss stats' key of one bucket's sum (formatted with a STALENESS_BUCKETS name and a what)."""
STALEST_SHARE_MAX, STALEST_SHARE_LAST = "stale/stalest_grad_share_max", "stale/stalest_grad_share_last"

BEHAV_WEIGHT_BIN = "behav_weight_bin/{:02d}"
"""The loss stats' key of bin i of the behaviour weight's histogram."""

_BASE_EDGES = (0.125, 0.25, 0.5, 0.8, 0.95, 1.05, 1.25, 2.0, 4.0, 8.0)
"""The histogram's edges without a cap: in pairs about 1 on a log scale (1/8 and 8, 1/4 and 4, 1/2
and 2, 0.8 and 1.25, 0.95 and about 1/0.95), finer near 1, where a centred bin (0.95, 1.05] holds
the weights of tokens whose policies agree."""


def length_buckets(lengths: Sequence[int] | np.ndarray, max_new_tokens: int) -> np.ndarray:
    """Each answer length's bucket index 0..3 (q1..q4): L <= 25%, <= 50%, <= 75% of max_new_tokens, above."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    bounds = np.array([0.25, 0.5, 0.75]) * max_new_tokens
    return np.searchsorted(bounds, np.asarray(lengths, dtype=np.float64), side="left").astype(np.int64)


def length_bucket_sums(lengths: Sequence[int], advantages: Sequence[np.ndarray], masks: Sequence[np.ndarray],
                       token_weights: Sequence[np.ndarray] | None, max_new_tokens: int) -> dict[str, float]:
    """The per-bucket sums of the module's docstring over one rank's answers (each a sum: add them
    over ranks). `advantages`, `masks` (the valid tokens) and `token_weights` (None: 1 per token,
    token-mean) hold one array per answer; `lengths` the answers' token counts. Every key is
    present, 0 for an empty bucket, so that every rank reduces the same values."""
    n = len(LENGTH_BUCKETS)
    adv_sum, adv_seqs, loss_weight = np.zeros(n), np.zeros(n), np.zeros(n)
    for i, b in enumerate(length_buckets(lengths, max_new_tokens)):
        mask = np.asarray(masks[i], dtype=bool)
        if not mask.any():
            continue  # no valid token: trains nothing
        adv = np.asarray(advantages[i], dtype=np.float64)[mask]
        weight = 1.0 if token_weights is None else np.asarray(token_weights[i], dtype=np.float64)[mask]
        adv_sum[b] += adv.mean()
        adv_seqs[b] += 1
        loss_weight[b] += float((np.abs(adv) * weight).sum())
    out: dict[str, float] = {}
    for k, name in enumerate(LENGTH_BUCKETS):
        out[ADV_SUM.format(name)] = float(adv_sum[k])
        out[ADV_SEQS.format(name)] = float(adv_seqs[k])
        out[LOSS_WEIGHT.format(name)] = float(loss_weight[k])
    return out


def length_bucket_metrics(sums: dict[str, float]) -> dict[str, float | None]:
    """From the bucket sums of the whole step: by_length/advantage/qK (the mean over the bucket's
    answers of their mean advantage; None without one) and by_length/loss_share/qK (the bucket's
    share of Σ |A|·token_weight; None when that is 0 everywhere, e.g. every advantage is 0). {}
    when `sums` has none."""
    if ADV_SUM.format(LENGTH_BUCKETS[0]) not in sums:
        return {}
    total = sum(sums.get(LOSS_WEIGHT.format(b), 0.0) for b in LENGTH_BUCKETS)
    out: dict[str, float | None] = {}
    for b in LENGTH_BUCKETS:
        n = sums.get(ADV_SEQS.format(b), 0.0)
        out[f"by_length/advantage/{b}"] = sums.get(ADV_SUM.format(b), 0.0) / n if n else None
    for b in LENGTH_BUCKETS:
        out[f"by_length/loss_share/{b}"] = sums.get(LOSS_WEIGHT.format(b), 0.0) / total if total > 0 else None
    return out


def behav_weight_edges(cap: float | None, floor: float | None = None) -> list[float]:
    """The behaviour weight histogram's n+1 edges: 0, then 1/8, 1/4, 1/2, 0.8, 0.95, 1.05, 1.25, 2,
    4, 8 (log-symmetric about 1, finer near it), doubling on past 8 to an edge above `cap` when the
    cap is larger, and the cap itself, so that the bins above it count exactly the weights the cap
    catches (w > cap); a positive `floor` is added as an edge too (the bins below it: w <= floor).

    Bin i counts e_i < w <= e_{i+1} (bin 0 also w = 0); the last bin also counts every weight above
    the last edge. With the default cap 5: 0, .125, .25, .5, .8, .95, 1.05, 1.25, 2, 4, 5, 8 (11 bins)."""
    edges = [0.0, *_BASE_EDGES]
    if cap is not None:
        while edges[-1] <= cap:  # one edge above the cap at least
            edges.append(2 * edges[-1])
    for bound in (cap, floor):
        if bound is not None and bound > 0 and not any(math.isclose(e, bound) for e in edges):
            edges.append(float(bound))
    return sorted(edges)


def behav_weight_bins(weight: torch.Tensor, mask: torch.Tensor, edges: Sequence[float]) -> torch.Tensor:
    """Counts [len(edges) - 1] of the valid tokens' weights per bin of `edges` (behav_weight_edges'
    rule: right-closed bins, the first one from 0, the last open above), in `weight`'s dtype."""
    n_bins = len(edges) - 1
    w = weight.detach().reshape(-1)
    inner = w.new_tensor(list(edges[1:-1]))
    # The number of inner edges strictly below w: bin i holds e_i < w <= e_{i+1}.
    index = (w.unsqueeze(-1) > inner).sum(-1)
    return _masked_onehot(index, mask, n_bins).sum(0).to(weight.dtype)


def _masked_onehot(index: torch.Tensor, mask: torch.Tensor, n: int) -> torch.Tensor:
    """[T, n] bool: token t's row has True at index[t] when the token is valid. Every token is
    binned and the mask applied to the rows: `x[mask]` has a size only the values tell, which on a
    GPU is a device synchronisation per micro-batch; and comparison rather than bincount, which has
    no deterministic CUDA kernel."""
    return (index.unsqueeze(-1) == index.new_tensor(list(range(n)))) & mask.reshape(-1).bool().unsqueeze(-1)


def ess_fraction(weight_sum: float, weight_sq_sum: float, n: float) -> float | None:
    """The effective sample size of weights over their number: (Σw)² / (N·Σw²), 1 when every weight
    is equal, about 1/N when one dominates; None without tokens or weights."""
    if n <= 0 or weight_sq_sum <= 0:
        return None
    return weight_sum * weight_sum / (n * weight_sq_sum)


def staleness_bucket(d: torch.Tensor) -> torch.Tensor:
    """Each token's STALENESS_BUCKETS index from its versions behind `d` (negative counts as 0)."""
    return (d.unsqueeze(-1) >= d.new_tensor(_STALENESS_LOW[1:])).sum(-1)


def staleness_bucket_sums(staleness: torch.Tensor, mask: torch.Tensor, weight: torch.Tensor, capped: torch.Tensor,
                          grad: torch.Tensor) -> dict[str, torch.Tensor]:
    """The module's per-bucket sums (0-d tensors in `weight`'s dtype) of one micro-batch: every key
    of every bucket, 0 for an empty one, so that micro-batches and ranks add the same keys."""
    hits = _masked_onehot(staleness_bucket(staleness.reshape(-1).long()), mask, len(STALENESS_BUCKETS))
    onehot = hits.to(weight.dtype)
    w = weight.detach().reshape(-1, 1)
    sums = {"tokens": onehot.sum(0), "weight_sum": (onehot * w).sum(0),
            "weight_max": w.expand_as(hits).masked_fill(~hits, 0.0).amax(0) if len(w) else onehot.sum(0),
            "capped": (onehot * capped.reshape(-1, 1).to(weight.dtype)).sum(0),
            "grad": (onehot * grad.detach().reshape(-1, 1).to(weight.dtype)).sum(0)}
    return {STALE.format(b, what): v[i] for what, v in sums.items() for i, b in enumerate(STALENESS_BUCKETS)}


def stalest_shares(minibatch_stats: Sequence[dict[str, float]]) -> dict[str, float]:
    """From each minibatch's stats (summed over its micro-batches and ranks): the share of its
    `grad` from the stalest bucket with tokens in the whole step, its largest over the minibatches
    and the last one's. {} without staleness sums or gradient."""
    if not minibatch_stats or STALE.format(STALENESS_BUCKETS[0], "tokens") not in minibatch_stats[0]:
        return {}
    present = [b for b in STALENESS_BUCKETS if sum(m.get(STALE.format(b, "tokens"), 0.0) for m in minibatch_stats) > 0]
    if not present:
        return {}
    shares = []
    for m in minibatch_stats:
        total = sum(m.get(STALE.format(b, "grad"), 0.0) for b in STALENESS_BUCKETS)
        shares.append(m.get(STALE.format(present[-1], "grad"), 0.0) / total if total > 0 else 0.0)
    return {STALEST_SHARE_MAX: max(shares), STALEST_SHARE_LAST: shares[-1]}


def staleness_metrics(stats: dict[str, float]) -> dict[str, float | None]:
    """From a step's stats: per bucket with tokens, stale/<bucket>/tokens, weight_mean, weight_max,
    capped_fraction and grad_share (of Σ grad over every bucket), plus the stalest-bucket shares.
    {} without staleness sums."""
    if STALE.format(STALENESS_BUCKETS[0], "tokens") not in stats:
        return {}
    total_grad = sum(stats.get(STALE.format(b, "grad"), 0.0) for b in STALENESS_BUCKETS)
    out: dict[str, float | None] = {}
    for b in STALENESS_BUCKETS:
        n = stats.get(STALE.format(b, "tokens"), 0.0)
        if n <= 0:
            continue
        out[f"stale/{b}/tokens"] = n
        out[f"stale/{b}/weight_mean"] = stats[STALE.format(b, "weight_sum")] / n
        out[f"stale/{b}/weight_max"] = stats[STALE.format(b, "weight_max")]
        out[f"stale/{b}/capped_fraction"] = stats[STALE.format(b, "capped")] / n
        out[f"stale/{b}/grad_share"] = stats[STALE.format(b, "grad")] / total_grad if total_grad > 0 else None
    for key in (STALEST_SHARE_MAX, STALEST_SHARE_LAST):
        if key in stats:
            out[key] = stats[key]
    return out


# ---- the behaviour/trainer mismatch by staleness --------------------------------------------------

MISMATCH = "mismatch/{}/{}"
"""The loss stats' key of one staleness bucket's mismatch sum (a STALENESS_BUCKETS name, a what)."""
MISMATCH_EDGES = tuple(m * 10.0 ** e for e in range(-6, 1) for m in (1.0, 3.0)) + (10.0,)
"""The edges of the |Δ log p| histogram that gives the p99: two per decade from 1e-6 to 10 (bin 0
holds |Δ| <= 1e-6, the last everything above 10)."""


def mismatch_sums(staleness: torch.Tensor, mask: torch.Tensor, delta: torch.Tensor, past: torch.Tensor
                  ) -> dict[str, torch.Tensor]:
    """Per staleness bucket, the sums of Δ_t = log π_start(t) − log π_behav(t) over the valid tokens
    (π_start: the trainer's own policy at the step's start): tokens, Σ|Δ|, max |Δ|, Σ k3 with
    k3 = e^Δ − 1 − Δ (Schulman's estimator of KL(π_behav ‖ π_start) from tokens π_behav sampled),
    the tokens `past` the correction's bounds, and the count per bin of MISMATCH_EDGES. Every key of
    every bucket, 0 when empty, so that micro-batches and ranks add the same keys."""
    d = delta.detach().reshape(-1).double()
    hits = _masked_onehot(staleness_bucket(staleness.reshape(-1).long()), mask, len(STALENESS_BUCKETS))
    onehot = hits.to(d.dtype)
    a = d.abs().unsqueeze(-1)
    k3 = (d.expm1() - d).unsqueeze(-1)  # expm1: exact near Δ = 0, where e^Δ − 1 − Δ is ~Δ²/2
    bins = (a > d.new_tensor(MISMATCH_EDGES)).sum(-1)  # bin j: e_{j-1} < |Δ| <= e_j
    per_bin = onehot.T @ _masked_onehot(bins, mask, len(MISMATCH_EDGES) + 1).to(d.dtype)  # [buckets, bins]
    sums = {"tokens": onehot.sum(0), "abs_sum": (onehot * a).sum(0),
            "abs_max": a.expand_as(hits).masked_fill(~hits, 0.0).amax(0) if len(d) else onehot.sum(0),
            "k3_sum": (onehot * k3).sum(0), "past": (onehot * past.reshape(-1, 1).to(d.dtype)).sum(0)}
    out = {MISMATCH.format(b, what): v[i] for what, v in sums.items() for i, b in enumerate(STALENESS_BUCKETS)}
    for i, b in enumerate(STALENESS_BUCKETS):
        out.update({MISMATCH.format(b, f"bin{j:02d}"): per_bin[i, j] for j in range(per_bin.shape[1])})
    return out


def _quantile(counts: Sequence[float], q: float) -> float | None:
    """The upper edge of the MISMATCH_EDGES bin where the cumulative count first reaches q of the
    total (the last bin, open above, gives its lower edge): an upper bound on the q-quantile."""
    total = sum(counts)
    if total <= 0:
        return None
    running = 0.0
    for j, c in enumerate(counts):
        running += c
        if running >= q * total - 1e-9:
            return MISMATCH_EDGES[j] if j < len(MISMATCH_EDGES) else MISMATCH_EDGES[-1]
    return MISMATCH_EDGES[-1]


def mismatch_metrics(stats: dict[str, float]) -> dict[str, float | None]:
    """From a step's stats: mismatch/<what> over every token and mismatch/<bucket>/<what> per bucket
    with tokens: tokens, abs_mean, abs_p99 (the upper edge of its histogram bin), abs_max, k3 (the
    mean k3: KL(π_behav ‖ π_start)) and past_fraction (the share past the correction's bounds).
    {} without mismatch sums."""
    if MISMATCH.format(STALENESS_BUCKETS[0], "tokens") not in stats:
        return {}
    n_bins = len(MISMATCH_EDGES) + 1

    def finished(get) -> dict[str, float | None]:
        n = get("tokens")
        return {"tokens": n, "abs_mean": get("abs_sum") / n, "abs_p99": _quantile([get(f"bin{j:02d}") for j in range(n_bins)], 0.99),
                "abs_max": get("abs_max"), "k3": get("k3_sum") / n, "past_fraction": get("past") / n}

    out: dict[str, float | None] = {}
    present = [b for b in STALENESS_BUCKETS if stats.get(MISMATCH.format(b, "tokens"), 0.0) > 0]
    for b in present:
        out.update({f"mismatch/{b}/{k}": v for k, v in finished(lambda what, b=b: stats[MISMATCH.format(b, what)]).items()})
    if present:
        def total(what: str) -> float:
            values = [stats[MISMATCH.format(b, what)] for b in present]
            return max(values) if what == "abs_max" else sum(values)
        out.update({f"mismatch/{k}": v for k, v in finished(total).items()})
    return out
