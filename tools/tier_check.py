"""The fast test tier against its two promises: it runs in under 3 minutes on 2 cores, and it
touches every module of areal_flow. Runs `pytest -m "not slow"` in this process, then lists the
modules of the package that no test of the tier imported (in this process: a module run only in a
child process counts as untouched) and prints the tier's wall time against the budget.

    python tools/tier_check.py [--budget 180] [pytest args ...]

Exit status: pytest's when the tier fails; else 1 when a module is untouched or the budget is
exceeded; else 0.
"""

from __future__ import annotations

import argparse
import pkgutil
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "areal_flow"


def all_modules() -> list[str]:
    """Every module of areal_flow, by dotted name (packages' __init__ included)."""
    names = ["areal_flow"]
    for info in pkgutil.walk_packages([str(PACKAGE)], prefix="areal_flow."):
        names.append(info.name)
    return sorted(names)


CHILD_PROGRAMS = {name: "the sandbox's init and the modules it imports beside it, run by tests/sandbox/test_sandbox.py "
                        "in the sandbox's child processes"
                  for name in ("areal_flow.sandbox.init", "areal_flow.sandbox.cases", "areal_flow.sandbox.program")}
"""Modules that run only as a child process's program, never imported by a test: not counted."""


def untouched(loaded: set[str]) -> list[str]:
    # __main__ modules run as `python -m`: their package being loaded is what a test can show.
    return [m for m in all_modules() if m not in loaded and not m.endswith(".__main__") and m not in CHILD_PROGRAMS]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=180.0, help="seconds the tier may take")
    args, rest = ap.parse_known_args()
    start = time.monotonic()
    # -n 0: in this process (pyproject's addopts run the suite in pytest-xdist workers), so that
    # sys.modules shows what the tier imported.
    code = pytest.main(["-m", "not slow", "-q", "-n", "0", "-p", "no:cacheprovider", str(ROOT / "tests"), *rest])
    seconds = time.monotonic() - start
    missing = untouched(set(sys.modules))
    print(f"\nfast tier: {seconds:.0f} s (budget {args.budget:.0f} s); modules untouched: {len(missing)}")
    for name in missing:
        print(f"  {name}")
    if code != 0:
        return int(code)
    return 1 if missing or seconds > args.budget else 0


if __name__ == "__main__":
    sys.exit(main())
