"""A function a config names by its import path, 'package.module:function'."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def import_callable(path: str) -> Callable:
    """The callable at 'package.module:attribute'. Raises ValueError saying what is wrong (no
    colon, a module that does not import, an attribute that is missing or not callable); callers
    put the config key in front."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError("expected 'module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import {module_name!r} ({e})") from None
    obj = getattr(module, attr, None)
    if not callable(obj):
        raise ValueError(f"{module_name!r} has no callable {attr!r}")
    return obj
