"""Registries of policy losses, advantage estimators and reward shapers, by name.

A recipe names a built-in (`algorithm.policy_loss: cispo`) or a function of the user's own by its
import path (`algorithm.policy_loss: my_pkg.losses:my_loss`); docs/algorithms.md has the signature
of each kind. The built-ins are `algorithms/builtins.py`'s, added the first time a name is looked up
or registered (it imports torch); a user's module may also call `register(...)` and be named by its
import path once.
"""

from __future__ import annotations

from collections.abc import Callable

from areal_flow.config.import_path import resolve_named

KINDS = ("policy_loss", "adv_estimator", "reward_shaper")

BUILTINS = {"policy_loss": ("cispo", "ppo"), "adv_estimator": ("gae", "returns"), "reward_shaper": ("overlong",)}
"""The names of `algorithms/builtins.py`, known without importing it (and torch): the config
checker uses them before any process starts."""

_REGISTRY: dict[str, dict[str, Callable]] = {kind: {} for kind in KINDS}
_builtins_loaded = False


def register(kind: str, name: str) -> Callable[[Callable], Callable]:
    """Decorator: `@register("policy_loss", "my_loss")` makes `algorithm.policy_loss: my_loss` find it."""
    if kind not in _REGISTRY:
        raise ValueError(f"unknown registry {kind!r}; the registries are {', '.join(KINDS)}")
    _load_builtins()  # first, so that a name of a built-in is refused, whatever was imported before

    def add(fn: Callable) -> Callable:
        _add(kind, name, fn)
        return fn

    return add


def _add(kind: str, name: str, fn: Callable) -> None:
    known = _REGISTRY[kind].get(name)
    if known is not None and known is not fn:
        raise ValueError(f"{kind} {name!r} is already registered ({_qualname(known)})")
    _REGISTRY[kind][name] = fn


def name_problem(kind: str, name: str, key: str) -> str | None:
    """Why `name` names no function of this kind, checked without importing torch: a built-in is
    fine, an import path is imported and looked up; None when it is usable."""
    try:
        resolve_named(name, dict.fromkeys(BUILTINS[kind]), where=f"{key}={name!r}",
                      unknown=lambda: _no_such(kind, name, key, f"built-in: {', '.join(BUILTINS[kind])}"))
    except ValueError as exc:
        return str(exc)
    return None


def names(kind: str) -> list[str]:
    _load_builtins()
    return sorted(_REGISTRY[kind])


def resolve(kind: str, name: str, key: str) -> Callable:
    """The function `name` stands for: a registered name, or 'module.path:attribute'. `key` is the
    config key that named it, for the error message."""
    _load_builtins()
    return resolve_named(name, _REGISTRY[kind], where=f"{key}={name!r}",
                         unknown=lambda: _no_such(kind, name, key, f"registered: {', '.join(names(kind))}"))


def _no_such(kind: str, name: str, key: str, known: str) -> str:
    return f"{key}={name!r}: no {kind} of that name; {known}, or give 'module.path:function'"


def _qualname(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def _load_builtins() -> None:
    global _builtins_loaded
    if _builtins_loaded:
        return
    from areal_flow.algorithms.builtins import FUNCTIONS  # here: it imports torch

    for kind, functions in FUNCTIONS.items():
        for name, fn in functions.items():
            _add(kind, name, fn)
    _builtins_loaded = True
