"""A mesh as a recipe writes it: a device list like '0', '0-3' or '0,2', parsed and printed."""

from __future__ import annotations

from typing import Any, Sequence


def format_mesh(mesh: Sequence[int] | None) -> str:
    """Sorted devices as a mesh is written: runs of three or more as 'a-b' ('0-7,9,10'); '-' when empty."""
    if not mesh:
        return "-"
    runs: list[list[int]] = []
    for d in mesh:
        if runs and d == runs[-1][-1] + 1:
            runs[-1].append(d)
        else:
            runs.append([d])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ",".join(map(str, r)) for r in runs)


def parse_mesh(spec: Any, where: str) -> tuple[tuple[int, ...] | None, str | None]:
    """'0', '0-3', '0,2' or an int -> sorted device indices; returns (mesh, problem)."""
    text = str(spec).strip()
    devices: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            first, last = int(lo), int(hi) if hi else int(lo)
            if first < 0 or last < first:
                raise ValueError
            devices.update(range(first, last + 1))
    except ValueError:
        return None, f"{where}: mesh {text!r} is not a device list like '0', '0-3' or '0,2'"
    return tuple(sorted(devices)), None
