"""The built-in policy losses, advantage estimators and reward shapers a recipe names by a word
(`algorithm.policy_loss: cispo`; docs/algorithms.md has each kind's signature).

`FUNCTIONS` lists them by kind and name; `registry.py` adds them to its registry the first time a
name is looked up (this module imports torch, which the config checker does without), and keeps
their names in `registry.BUILTINS`. Each takes the whole `AlgorithmConfig`, as a user's own function
does, so that it may read any field it needs; the math is in the pure functions it calls.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from areal_flow.algorithms import corrections
from areal_flow.algorithms.advantages import gae
from areal_flow.algorithms.ppo import decoupled_ppo_loss
from areal_flow.algorithms.shaping import overlong_penalty

Stats = dict[str, torch.Tensor]


# ---- built-in policy losses: fn(logprobs, prox, batch, mask, denominator, algo) -> (loss, stats) ----


def ppo(logprobs, prox, batch, mask, denominator, algo) -> tuple[torch.Tensor, Stats]:
    """PPO clip (asymmetric with eps_clip_high, dual with c_clip; GSPO with importance_level=sequence)
    with the behaviour weight π_prox/π_behav of the decoupled objective when there is a π_prox."""
    return _policy(logprobs, prox, batch, mask, denominator, algo, kind="ppo")


def cispo(logprobs, prox, batch, mask, denominator, algo) -> tuple[torch.Tensor, Stats]:
    """CISPO (MiniMax-M1): REINFORCE weighted by the clipped, stop-gradient importance ratio, so
    that every token keeps a gradient."""
    return _policy(logprobs, prox, batch, mask, denominator, algo, kind="cispo")


def policy_terms(fn: Callable, logprobs, prox, batch, mask, denominator, algo) -> torch.Tensor | None:
    """Each token's term of the built-in policy loss `fn` (they sum to its loss), for inspection;
    None for a loss of the user's own, which gives its sum alone."""
    kind = {ppo: "ppo", cispo: "cispo"}.get(fn)
    if kind is None:
        return None
    return _policy(logprobs, prox, batch, mask, denominator, algo, kind=kind, per_token=True)[0]


def _policy(logprobs, prox, batch, mask, denominator, algo, kind: str,
            per_token: bool = False) -> tuple[torch.Tensor, Stats]:
    p = corrections.configured(algo)
    return decoupled_ppo_loss(
        logprobs, prox, batch["behav_logprobs"], batch["advantages"], mask, kind=kind,
        eps_clip=algo.eps_clip, eps_clip_high=algo.eps_clip_high, c_clip=algo.c_clip,
        importance_level=algo.importance_level, seq_ids=batch.get("seq_ids"),
        correction=algo.correction, behav_weight_cap=p.high, behav_weight_floor=p.low, correction_tau=p.tau,
        correction_level=algo.correction_level, token_weights=batch.get("token_weights"),
        n_valid_tokens=denominator, entropy=batch.get("entropy"), staleness=batch.get("staleness"),
        clip_behav=algo.clip_behav, per_token=per_token)


# ---- built-in advantage estimators:
# fn(token_rewards [N,T], values [N,T] | None, mask, algo) -> (advantages [N,T], critic targets [N,T]) ----


def gae_estimator(rewards, values, mask, algo) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE(γ, λ) against the critic's values, whose targets are A + V; without a critic the values
    are 0, and with γ = λ = 1 every token's advantage is its return-to-go (REINFORCE; GRPO once the
    rewards are normalised)."""
    if values is None:
        values = torch.zeros_like(rewards)
    return gae(rewards, values, mask, algo.gamma, algo.gae_lambda)


def returns_estimator(rewards, values, mask, algo) -> tuple[torch.Tensor, torch.Tensor]:
    """γ-discounted returns-to-go, ignoring any critic (REINFORCE, REINFORCE++)."""
    returns = gae(rewards, torch.zeros_like(rewards), mask, algo.gamma, 1.0)[0]
    return returns, returns


# ---- built-in reward shapers: fn(scores [N], lengths [N], truncated [N] bool, algo) -> [N] ----


def overlong(scores, lengths, truncated, algo) -> torch.Tensor:
    """DAPO's soft overlong penalty over the last `overlong_tokens` before max_new_tokens."""
    if algo.overlong_tokens is None:
        raise ValueError("reward shaper 'overlong' needs algorithm.overlong_tokens")
    return scores + overlong_penalty(lengths, max_new_tokens=algo.max_new_tokens,
                                     overlong_tokens=algo.overlong_tokens, factor=algo.overlong_penalty_factor)


FUNCTIONS: dict[str, dict[str, Callable]] = {
    "policy_loss": {"ppo": ppo, "cispo": cispo},
    "adv_estimator": {"gae": gae_estimator, "returns": returns_estimator},
    "reward_shaper": {"overlong": overlong},
}
