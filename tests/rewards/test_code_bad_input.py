"""Bad programs through the code reward as a run scores them (a reward node's worker process, its
resident sandbox), in every shape of tests: each scores 0 with a test status, leaves its worker able
to score the next program, and leaves no process behind."""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest

from areal_flow.config.schema import SandboxConfig
from areal_flow.sandbox.local import CHECKER_UID_SHIFT, UID_BASE
from areal_flow.rewards.service import NodeScorer, Shaping

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox's namespaces need root, as on CI")

CFG = SandboxConfig(wall_seconds=1.0, cpu_seconds=1, processes=16)

# Every program defines f, which should double its argument; the stdin shape calls it on a line.
SHAPES = {
    "stdin": ({"inputs": ["1", "2"], "outputs": ["2", "4"]}, "\nprint(f(int(input())))\n"),
    "fn_name": ({"inputs": [[1], [2]], "outputs": [2, 4], "fn_name": "f"}, ""),
    "asserts": ({"asserts": ["assert f(1) == 2", "assert f(2) == 4"]}, ""),
    "check": ({"test": "def check(candidate):\n    assert candidate(1) == 2\n", "entry_point": "f"}, ""),
}
GOOD = "def f(x):\n    return 2 * x\n"
PRINTS_100_MB = "def f(x):\n    print('x' * 100_000_000)\n    return 2 * x\n"
FORK_BOMB = "import os\ndef f(x):\n    while True:\n        try:\n            os.fork()\n        except OSError:\n            pass\n"
FORK_OUTLIVES = ("import os, time\ndef f(x):\n    if os.fork() == 0:\n        os.setsid()\n        time.sleep(60)\n"
                 "        os._exit(0)\n")
SLEEPS = "import time\ndef f(x):\n    time.sleep(60)\n"
READS_STDIN_FOREVER = "import sys\ndef f(x):\n    while True:\n        sys.stdin.read()\n"
RECURSES = "def f(x):\n    return f(x + 1)\n"
IMPORTS_MISSING = "import no_such_module\ndef f(x):\n    return 2 * x\n"
UNENCODABLE = "def f(x):\n    return {object()}\n"
slow = pytest.mark.slow  # a second of deadline per shape: the full suite runs them

# (program, the first test's status in each shape: stdin, fn_name, asserts, check)
BAD = {
    "prints 100 MB": (PRINTS_100_MB, ("output_limit",) * 4),
    "fork bomb": pytest.param(FORK_BOMB, ("timeout",) * 4, marks=slow),
    "a fork that outlives it": (FORK_OUTLIVES, ("wrong_answer",) * 4),  # f returns None; the daemon is killed
    "sleeps": pytest.param(SLEEPS, ("timeout",) * 4, marks=slow),
    "reads stdin forever": pytest.param(READS_STDIN_FOREVER, ("timeout",) * 4, marks=slow),
    "recurses without end": (RECURSES, ("runtime_error",) * 4),
    "imports a module that does not exist": (IMPORTS_MISSING, ("runtime_error",) * 4),
    # A printed line compares unequal; a set holding an object is not plain data, so it never reaches a check.
    "returns what JSON cannot encode": (UNENCODABLE, ("wrong_answer", "not_plain", "not_plain", "not_plain")),
}


def descendants(pid: int) -> dict[int, int]:
    """pid -> uid of every process below `pid` (read from /proc: it sees every PID namespace below ours)."""
    parent, uid = {}, {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/status") as f:
                    fields = dict(line.split(":", 1) for line in f if ":" in line)
            except OSError:
                continue
            parent[int(entry)] = int(fields["PPid"])
            uid[int(entry)] = int(fields["Uid"].split()[0])
    found, frontier = {}, [pid]
    while frontier:
        p = frontier.pop()
        for child in [c for c, pp in parent.items() if pp == p]:
            found[child] = uid[child]
            frontier.append(child)
    return found


def programs_left(seconds: float = 5.0) -> dict[int, int]:
    """The sandboxed programs (a sandbox uid) still below this process after up to `seconds`."""
    deadline = time.monotonic() + seconds
    while (left := {p: u for p, u in descendants(os.getpid()).items() if u >= UID_BASE - CHECKER_UID_SHIFT}) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


@pytest.fixture(scope="module")
def scorer():
    """One worker process, as a reward node with workers: 1 runs it."""
    before = set(descendants(os.getpid()))  # what earlier tests left is theirs to answer for
    node = NodeScorer("reward", "code", workers=1, timeout=60, shaping=Shaping(), sandbox=CFG)
    yield node
    node.close()
    deadline = time.monotonic() + 5.0  # a killed process is gone a moment later, not at once
    while (left := scorers_processes(before)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert left == {}, "a worker, a sandbox init or a program outlived the scorer"


def scorers_processes(before: set[int]) -> dict[int, str]:
    """pid -> command line of the processes below this one that were not there before the scorer;
    multiprocessing's resource tracker serves this process until it exits: not the scorer's."""
    new = {p: cmdline(p) for p in set(descendants(os.getpid())) - before}
    return {p: cmd for p, cmd in new.items() if "multiprocessing.resource_tracker" not in cmd}


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""  # gone


def score(scorer, program: str, shape: str):
    tests, call = SHAPES[shape]
    return asyncio.run(scorer.score(f"```python\n{program}{call}```", json.dumps(tests)))


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("program, expected", list(BAD.values()), ids=list(BAD))
def test_a_bad_program_scores_0_with_a_status_and_leaves_nothing_behind(scorer, program, expected, shape):
    got = score(scorer, program, shape)
    status = expected[list(SHAPES).index(shape)]
    assert got.raw == 0.0
    assert got.stats[f"tests_{status}"] > 0, {k: v for k, v in got.stats.items() if v and k.startswith("tests_")}
    assert (got.stats["timeout"], got.stats["error"]) == (0.0, 0.0)  # the sandbox ended it, not the worker's timeout
    assert got.stats["seconds"] < 2 * CFG.wall_seconds + 2
    assert programs_left() == {}, "a process of the program outlived its scoring"
    # The same worker scores the next program: nothing is stuck.
    assert score(scorer, GOOD, shape).raw == 1.0
