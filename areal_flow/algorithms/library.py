"""The two steps a train node runs with the losses, estimators and shapers a recipe names
(docs/algorithms.md; the built-ins are in `builtins.py`, found by name through `registry.py`).

1. `advantages`, once per train batch: reward shapers → reward normalisation → token rewards (the
   score at each answer's last token, minus the KL penalty when KL is a reward) → the advantage
   estimator → advantage normalisation.
2. `objective`, per micro-batch: π_prox as the step provides it, the policy loss, plus KL as a loss
   term when it is one.

The math lives in the pure functions of `ppo.py`, `advantages.py`, `kl.py`, `shaping.py` and
`prox.py`; this module only reads the config and calls them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np
import torch

from areal_flow.algorithms import corrections
from areal_flow.algorithms.advantages import normalize, token_rewards
from areal_flow.algorithms.critic import value_loss
from areal_flow.algorithms.diagnostics import mismatch_sums
from areal_flow.algorithms.kl import kl_estimate
from areal_flow.algorithms.ppo import aggregation_weight
from areal_flow.algorithms.prox import loglinear_prox
from areal_flow.algorithms.registry import resolve

Stats = dict[str, torch.Tensor]
AllReduce = Callable[[torch.Tensor], torch.Tensor]

PROX_SOURCES = ("data", "current", "behav", "loglinear")
"""Where a step's π_prox comes from: the prox node's output ('data'); the trained logprobs
themselves, exact when the whole update is one optimizer step ('current'); the behaviour logprobs,
exact when every token was sampled by the current weights ('behav'); or AReaL's log-linear
interpolation by per-token version ('loglinear')."""


def shapers(algo) -> list[Callable]:
    """The reward shapers a config applies, in order: 'overlong' first when overlong_tokens is set."""
    chosen = (["overlong"] if algo.overlong_tokens is not None else []) + list(algo.reward_shapers)
    return [resolve("reward_shaper", name, "algorithm.reward_shapers") for name in chosen]


# ---- step 1: advantages ------------------------------------------------------------------------


def padded(rows: Sequence[np.ndarray], dtype=torch.float32) -> torch.Tensor:
    """[N, max_len] from ragged rows, 0 beyond each row's end."""
    out = torch.zeros(len(rows), max((len(r) for r in rows), default=0), dtype=dtype)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.tensor(np.asarray(r), dtype=dtype)  # a copy: sample arrays are read-only
    return out


def advantages(scores: torch.Tensor, masks: Sequence[np.ndarray], truncated: Sequence[bool], algo, *,
               kl: Sequence[np.ndarray] | None = None, kl_coef: float = 0.0,
               values: Sequence[np.ndarray] | None = None,
               all_reduce: AllReduce | None = None) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per-answer-token (advantages, critic targets) of one train batch (N answers, whole groups
    in order).

    scores: [N] rewards; masks: each answer's loss mask; `kl` (per token, against the reference)
    enters as a reward penalty −kl_coef·kl when given; `values` are the critic's. `all_reduce` sums
    batch-level statistics over the data-parallel ranks. The targets are the estimator's, before
    advantage normalisation."""
    lengths = torch.tensor([len(m) for m in masks], dtype=torch.float32)
    for shape in shapers(algo):
        scores = shape(scores, lengths, torch.tensor(list(truncated), dtype=torch.bool), algo)
    scores = normalize(scores, group_size=algo.group_size, all_reduce=all_reduce, **dataclasses.asdict(algo.reward_norm))
    mask = padded(masks, torch.bool)
    penalty = -kl_coef * padded(kl) if kl is not None and kl_coef else None
    rewards = token_rewards(scores, mask, penalty)
    estimator = resolve("adv_estimator", algo.adv_estimator, "algorithm.adv_estimator")
    adv, targets = estimator(rewards, padded(values) if values is not None else None, mask, algo)
    adv = normalize(adv, group_size=algo.group_size, mask=mask, all_reduce=all_reduce, **dataclasses.asdict(algo.adv_norm))
    return unpadded(adv, masks), unpadded(targets, masks)


def unpadded(x: torch.Tensor, masks: Sequence[np.ndarray]) -> list[np.ndarray]:
    return [x[i, :len(m)].detach().numpy().astype(np.float32) for i, m in enumerate(masks)]


def aggregation(masks: Sequence[np.ndarray], algo) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per token: the weight of its loss and its share of the global denominator, so that
    Σ weight·loss / Σ share is the configured aggregation over the whole global batch."""
    norm_length = algo.loss_agg_norm_length or algo.max_new_tokens
    weights, shares = [], []
    for m in masks:
        w, s = aggregation_weight(algo.loss_agg, int(np.asarray(m).sum()), norm_length)
        weights.append(np.full(len(m), w, dtype=np.float32))
        shares.append(np.full(len(m), s, dtype=np.float32))
    return weights, shares


ADVANTAGE_PROPORTIONAL = frozenset({"ppo", "cispo"})
"""The policy losses whose every token term is its advantage times a factor (clipped or not): a
token with advantage 0 adds 0 to the loss and to its gradient."""


def zero_gradient(advantages: Sequence[np.ndarray], algo, *, kl_in_loss: bool) -> list[bool]:
    """Per answer: whether its terms of the objective and their gradient are exactly 0, so that a
    train step need not run it (it still counts in the loss's denominator). True only where every
    advantage of the answer is exactly 0, the policy loss is one of ADVANTAGE_PROPORTIONAL and no
    KL term is in the loss (`kl_in_loss`: a KL penalty has a gradient whatever the advantage)."""
    if not algo.skip_zero_advantage or kl_in_loss or algo.policy_loss not in ADVANTAGE_PROPORTIONAL:
        return [False] * len(advantages)
    return [not np.any(a) for a in advantages]


# ---- step 2: the objective of one micro-batch ----------------------------------------------------


def objective(logprobs: torch.Tensor, batch: dict[str, torch.Tensor], mask: torch.Tensor, denominator: float, *,
              algo, prox_source: str | None, prox_version: int, kl_coef: float,
              at_start: bool = False) -> tuple[torch.Tensor, Stats]:
    """The loss the train node minimises on one micro-batch: the policy loss, plus kl_coef·KL to the
    reference when KL is a loss term (kl_in=loss). `prox_source` None is naive PPO against π_behav.
    `at_start`: no optimizer step of this train step has run yet (its first minibatch), so that
    `logprobs` are the trainer's own at the step's start; with them, or with an exact π_prox, the
    stats carry the behaviour/trainer mismatch (`mismatch`)."""
    prox, batch = _with_prox(logprobs, batch, prox_source, prox_version)
    policy_loss = resolve("policy_loss", algo.policy_loss, "algorithm.policy_loss")
    loss, stats = policy_loss(logprobs, prox, batch, mask, denominator, algo)
    # π_prox from the prox node or the step's first forward is the trainer's policy at the step's
    # start; the shortcut 'behav' and the log-linear π_prox are not, and then only the first
    # minibatch's own logprobs are.
    start = prox if prox_source in ("data", "current") else logprobs.detach() if at_start else None
    if start is not None:
        stats.update(mismatch(start, batch, mask, algo))
    if algo.kl_in == "loss" and kl_coef and "ref_logprobs" in batch:
        kl, weighted = _kl_terms(logprobs, batch, mask, algo)
        kl_loss = weighted.sum() / max(float(denominator), 1.0)
        loss = loss + kl_coef * kl_loss
        stats["kl_sum"] = torch.where(mask, kl, torch.zeros_like(kl)).sum().detach()
    return loss, stats


def objective_terms(logprobs: torch.Tensor, batch: dict[str, torch.Tensor], mask: torch.Tensor, denominator: float,
                    *, algo, prox_source: str | None, prox_version: int, kl_coef: float) -> torch.Tensor | None:
    """Each token's term of `objective` (they sum to its loss, up to rounding; 0 where masked), for
    inspection (`python -m areal_flow.replay --dump`); None when the policy loss is the user's own."""
    from areal_flow.algorithms.builtins import (
        policy_terms,  # (registry.py loads it lazily too)
    )

    prox, batch = _with_prox(logprobs, batch, prox_source, prox_version)
    policy_loss = resolve("policy_loss", algo.policy_loss, "algorithm.policy_loss")
    terms = policy_terms(policy_loss, logprobs, prox, batch, mask, denominator, algo)
    if terms is not None and algo.kl_in == "loss" and kl_coef and "ref_logprobs" in batch:
        _, weighted = _kl_terms(logprobs, batch, mask, algo)
        terms = terms + kl_coef * torch.where(mask, weighted, torch.zeros_like(weighted)) / max(float(denominator), 1.0)
    return terms


def _with_prox(logprobs: torch.Tensor, batch: dict[str, torch.Tensor], source: str | None,
               prox_version: int) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """π_prox as the step provides it, and the batch with each token's versions behind this step's
    start (for the diagnostics) where it has versions."""
    prox = prox_logprobs(logprobs, batch, source, prox_version)
    if "versions" in batch:
        batch = {**batch, "staleness": prox_version - batch["versions"]}
    return prox, batch


def _kl_terms(logprobs: torch.Tensor, batch: dict[str, torch.Tensor], mask: torch.Tensor,
              algo) -> tuple[torch.Tensor, torch.Tensor]:
    """The KL estimate to the reference per token, and weighted by the aggregation weights."""
    kl = kl_estimate(logprobs, batch["ref_logprobs"], mask, algo.kl_estimator, algo.kl_clamp)
    weights = batch.get("token_weights")
    return kl, kl * weights if weights is not None else kl


def mismatch(start: torch.Tensor, batch: dict[str, torch.Tensor], mask: torch.Tensor, algo) -> Stats:
    """The sums of diagnostics.mismatch_sums for one micro-batch: Δ = log π_start − log π_behav
    per valid token, by staleness (0 without versions), and the tokens the configured correction
    would mask or truncate at the step's start."""
    start = start.detach()
    delta = torch.where(mask, start - batch["behav_logprobs"].to(start.dtype), torch.zeros_like(start))
    _, past = corrections.apply(algo.correction, delta, mask, corrections.configured(algo), level=algo.correction_level,
                                seq_ids=batch.get("seq_ids"))
    staleness = batch.get("staleness")
    if staleness is None:
        staleness = torch.zeros(mask.shape, dtype=torch.long, device=mask.device)
    return mismatch_sums(staleness, mask, delta, past)


def critic_objective(values: torch.Tensor, batch: dict[str, torch.Tensor], mask: torch.Tensor, denominator: float, *,
                     algo) -> tuple[torch.Tensor, Stats]:
    """The critic's clipped value loss on one micro-batch, toward the estimator's targets."""
    return value_loss(values, batch["values"], batch["returns"], mask, value_clip=algo.value_clip,
                      kind=algo.value_loss, huber_delta=algo.huber_delta, n_valid_tokens=denominator)


def prox_logprobs(logprobs: torch.Tensor, batch: dict[str, torch.Tensor], source: str | None,
                  prox_version: int) -> torch.Tensor | None:
    if source is None:
        return None
    if source == "data":
        return batch["prox_logprobs"]
    if source == "current":
        return logprobs.detach()
    if source == "behav":
        return batch["behav_logprobs"]
    if source == "loglinear":
        return loglinear_prox(logprobs, batch["behav_logprobs"], batch["versions"], prox_version)
    raise ValueError(f"unknown prox source {source!r}; known: {', '.join(PROX_SOURCES)}")
