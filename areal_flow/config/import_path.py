"""What a config value names: a built-in by its word, or a function of the user's own by its import
path, 'package.module:function'.

Losses, estimators and shapers (algorithms/registry.py), reward functions (rewards/service.py),
environments (envs/registry.py) and agents (agents/runner.py) are all named so, and resolved by
`resolve_named`; each caller says what its built-ins are and how its errors begin (the config key).
"""

from __future__ import annotations

import importlib
import traceback
from collections.abc import Callable, Mapping
from typing import Any


def _where(e: BaseException) -> str:
    """'FILE, line N' of what stopped a module's import: a SyntaxError's own place (the file that
    does not compile), else the innermost frame of the traceback outside importlib's machinery."""
    if isinstance(e, SyntaxError) and e.filename:
        return f"{e.filename}, line {e.lineno}"
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith("<frozen ")]
    return f"{frames[-1].filename}, line {frames[-1].lineno}" if frames else "?"


def import_callable(path: str) -> Callable:
    """The callable at 'package.module:attribute'. Raises ValueError saying what is wrong in one
    line (no colon; a module that does not import, with the file and line that stopped it: a syntax
    error, or an exception its code raised; an attribute that is missing or not callable); callers
    put the config key in front."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError("expected 'module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        missing = e.name is not None and (module_name == e.name or module_name.startswith(e.name + "."))
        # The module (or its package) is not there; else an import inside it failed, at a line of its own.
        raise ValueError(f"cannot import {module_name!r} ({e})" + ("" if missing else f" at {_where(e)}")) from None
    except SyntaxError as e:  # IndentationError, TabError too
        raise ValueError(f"cannot import {module_name!r}: {type(e).__name__} at {_where(e)}: {e.msg}") from None
    except Exception as e:  # noqa: BLE001 - the module's own code raised while it was imported
        first = str(e).splitlines()[0] if str(e) else ""
        raise ValueError(f"cannot import {module_name!r}: {type(e).__name__}{': ' + first if first else ''} "
                         f"at {_where(e)}") from None
    obj = getattr(module, attr, None)
    if not callable(obj):
        raise ValueError(f"{module_name!r} has no callable {attr!r}")
    return obj


def resolve_named(name: str, builtins: Mapping[str, Any], *, where: str, unknown: Callable[[], str]) -> Any:
    """`builtins[name]`, else the callable at 'package.module:attribute'. A name that is neither (no
    colon) raises ValueError(unknown()), the caller's message (its key, the name and what is built
    in); an import path that does not resolve raises ValueError('<where>: <what is wrong>')."""
    if name in builtins:
        return builtins[name]
    if ":" not in name:
        raise ValueError(unknown())
    try:
        return import_callable(name)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
