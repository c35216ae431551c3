"""The off-policy corrections by name, the bounds each reads and its source's values for them
(algorithms/corrections.py has the functions). No torch here: the launcher's checks and the
controller's metrics read it."""

from __future__ import annotations

import math
from dataclasses import dataclass

CORRECTIONS = ("areal", "tis", "mis", "icepop", "m2po", "mismatch_mask", "vtrace")
"""The corrections by name (algorithm.correction)."""


@dataclass(frozen=True)
class Params:
    """Which of the shared bounds a correction reads, and its source's values for them."""

    low: float | None = None  # the lower bound on w (None: no lower bound)
    high: float | None = None  # the upper bound on w (None: none)
    tau: float | None = None  # a bound on (log w)² or |log w|
    reads: tuple[str, ...] = ()  # the keys of algorithm.* it reads: low → behav_weight_floor, ...
    levels: tuple[str, ...] = ("token",)


DEFAULTS: dict[str, Params] = {
    "areal": Params(high=5.0, reads=("high", "low")),
    "tis": Params(high=2.0, reads=("high",), levels=("token", "sequence")),
    "mis": Params(high=2.0, reads=("high",), levels=("token", "sequence")),
    "icepop": Params(low=0.5, high=5.0, reads=("high", "low")),
    "m2po": Params(tau=0.04, reads=("tau",)),
    "mismatch_mask": Params(tau=math.log(2.0), reads=("tau",)),
    "vtrace": Params(high=1.0, reads=("high",)),
}
"""Each correction's parameters as its source sets them; a config's bound that is set replaces them."""

KEYS = {"low": "behav_weight_floor", "high": "behav_weight_cap", "tau": "correction_tau"}
"""The algorithm.* key of each shared bound."""


def resolve(name: str, *, low: float | None, high: float | None, tau: float | None) -> Params:
    """The correction's parameters with the configured bounds (None: the source's value) in place.
    `high` = inf is no upper bound (AReaL v0.3.0's uncapped weight)."""
    if name not in DEFAULTS:
        raise ValueError(f"unknown correction {name!r}; expected one of {', '.join(map(repr, CORRECTIONS))}")
    d = DEFAULTS[name]
    high = d.high if high is None else high
    return Params(low=d.low if low is None else low, high=None if high is not None and math.isinf(high) else high,
                  tau=d.tau if tau is None else tau, reads=d.reads, levels=d.levels)


def weight_bounds(name: str, params: Params) -> tuple[float | None, float | None]:
    """(floor, cap) of w that the correction acts beyond, for the weight histogram's edges: None
    where it has none on w itself (m2po; mismatch_mask's is e^±τ)."""
    if name == "mismatch_mask":
        return math.exp(-params.tau), math.exp(params.tau)
    if name == "m2po":
        return None, None
    return params.low, params.high


def configured(algo) -> Params:
    """An AlgorithmConfig's correction's bounds: the keys that are set, its source's values for the rest."""
    return resolve(algo.correction, low=algo.behav_weight_floor, high=algo.behav_weight_cap, tau=algo.correction_tau)


def configured_bounds(algo) -> tuple[float | None, float | None]:
    """(floor, cap) of w under an AlgorithmConfig's correction (`weight_bounds` of its resolved bounds)."""
    return weight_bounds(algo.correction, configured(algo))
