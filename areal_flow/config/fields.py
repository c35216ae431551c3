"""A config field: its default, one line of help and its allowed values, declared together."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any


def doc(default: Any = dataclasses.MISSING, help: str = "", factory: Any = None, *, ge: float | None = None,
        gt: float | None = None, le: float | None = None, choices: tuple | None = None) -> Any:
    """A dataclass field with a one-line help text (shown by `tools/config_reference.py`) and its
    allowed values: `ge`/`gt`/`le` bounds and `choices`; a null value is never range-checked."""
    bounds = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("choices", choices)) if v is not None}
    meta = {"help": help, **bounds}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)
