"""KL penalty to a reference policy, per token, and its coefficient (fixed or adaptive)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from areal_flow.config.schema import AlgorithmConfig


def kl_k3(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, n_valid_tokens: float
) -> torch.Tensor:
    """Schulman's k3 estimator of KL(π‖π_ref), summed over valid tokens / n_valid_tokens.

    Shapes: all [T] (or all [B, T]); mask bool. k3 = exp(ref − logp) − 1 − (ref − logp) ≥ 0,
    unbiased, and its gradient pulls π toward π_ref; clamped to 10 as AReaL does.
    This is `kl_estimate(..., "k3", clamp=10)` reduced to one number.
    """
    k3 = kl_estimate(logprobs, ref_logprobs, mask, "k3", clamp=10.0)
    return k3.sum() / max(float(n_valid_tokens), 1.0)

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    estimator: str = "k3",
    clamp: float | None = 10.0,
) -> torch.Tensor:
    """Per-token estimate of KL(π‖π_ref) from the sampled token's log-probabilities (Schulman's blog).

    With d = logp − ref (the token was sampled from π):

        k1 = d                      unbiased, can be negative
        k2 = d² / 2                 ≥ 0, biased, low variance
        k3 = exp(−d) − 1 + d        ≥ 0, unbiased

    each clamped to [−clamp, clamp] when `clamp` is set (AReaL/OpenRLHF use 10), and 0 at masked
    positions. Same shape as the inputs ([T] or [B, T]). The gradient flows through `logprobs` (so it can
    be a loss term); `ref_logprobs` is a constant.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    if clamp is not None and clamp <= 0:
        raise ValueError(f"clamp must be > 0 or None, got {clamp}")
    for name, t in (("ref_logprobs", ref_logprobs), ("mask", mask)):
        if t.shape != logprobs.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, logprobs has {tuple(logprobs.shape)}")
    mask = mask.bool()
    # Zero the masked positions first: torch.where alone would still let inf - inf = NaN from the
    # unselected branch poison the backward pass (0 * NaN = NaN).
    zero = torch.zeros_like(logprobs)
    d = torch.where(mask, logprobs, zero) - torch.where(mask, ref_logprobs.detach().to(logprobs.dtype), zero)
    if estimator == "k1":
        k = d
    elif estimator == "k2":
        k = d * d / 2
    else:
        if clamp is not None:
            # exp(−d) overflows for very negative d, and its inf gradient times the clamp's 0 is NaN.
            # For −d ≥ clamp + 1, k3 ≥ (clamp + 1)²/2 > clamp already, so bounding d there changes no
            # clamped value and no gradient (both are flat beyond the clamp).
            d = d.clamp(min=-(clamp + 1.0))
        # expm1 rather than exp(−d) − 1: for tiny d, exp(−d) rounds to 1 and the sum to d, which is
        # negative half the time; expm1(−d) ≥ −d holds in floating point too, so k3 stays ≥ 0.
        k = torch.expm1(-d) + d
    if clamp is not None:
        k = k.clamp(min=-clamp, max=clamp)
    return torch.where(mask, k, zero)


@dataclass
class AdaptiveKLController:
    """The adaptive KL coefficient of Ziegler et al. 2019 (as in OpenRLHF and veRL).

    After each step with measured KL `current_kl` over `n_samples` samples:

        err  = clip(current_kl / target − 1, −0.2, 0.2)
        coef ← coef · (1 + err · n_samples / horizon)

    so the coefficient moves by at most 20% per `horizon` samples, up when the KL is above target and
    down when below. The factor is floored at 0 (a huge n_samples / horizon cannot flip the sign).
    """

    coef: float
    target: float
    horizon: int

    def __post_init__(self) -> None:
        if self.target <= 0:
            raise ValueError(f"target must be > 0, got {self.target}")
        if self.horizon < 1:
            raise ValueError(f"horizon must be >= 1, got {self.horizon}")
        if self.coef < 0:
            raise ValueError(f"coef must be >= 0, got {self.coef}")

    def update(self, current_kl: float, n_samples: int) -> float:
        if n_samples < 0:
            raise ValueError(f"n_samples must be >= 0, got {n_samples}")
        err = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.coef *= max(1.0 + err * n_samples / self.horizon, 0.0)
        return self.coef

    def state_dict(self) -> dict:
        # Only the coefficient changes; target and horizon come from the config on resume.
        return {"coef": self.coef}

    def load_state_dict(self, d: dict) -> None:
        self.coef = float(d["coef"])


@dataclass
class FixedKLController:
    """A constant KL coefficient with AdaptiveKLController's interface: update() changes nothing."""

    coef: float

    def update(self, current_kl: float, n_samples: int) -> float:
        return self.coef

    def state_dict(self) -> dict:
        return {"coef": self.coef}

    def load_state_dict(self, d: dict) -> None:
        self.coef = float(d["coef"])


def kl_controller(algo: AlgorithmConfig) -> AdaptiveKLController | FixedKLController:
    """β toward the reference model as the config sets it: adaptive with `kl_target`, else fixed."""
    if algo.kl_target is None:
        return FixedKLController(algo.kl_coef)
    return AdaptiveKLController(coef=algo.kl_coef, target=algo.kl_target, horizon=algo.kl_horizon)


def behaviour_kl(behav_logprobs: Sequence[np.ndarray], ref_logprobs: Sequence[np.ndarray],
                 masks: Sequence[np.ndarray], estimator: str, clamp: float | None,
                 all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> float:
    """The batch's mean KL estimate of π_behav to π_ref over its valid tokens (per answer: logprobs
    and loss mask): what an adaptive β steers. `all_reduce` sums the [total, tokens] pair over the
    data-parallel ranks, so that every rank gets the mean of the global batch."""
    total = torch.zeros(2, dtype=torch.float64)
    for b, r, m in zip(behav_logprobs, ref_logprobs, masks):
        mask = torch.from_numpy(np.asarray(m, dtype=bool))
        total[0] += kl_estimate(torch.tensor(b), torch.tensor(r), mask, estimator, clamp).double().sum()
        total[1] += float(mask.sum())
    if all_reduce is not None:
        total = all_reduce(total)
    return float(total[0] / total[1].clamp(min=1))
