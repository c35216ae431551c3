"""The code reward against programs that try to earn it without solving the task, by attack class,
in every shape of tests, through the real sandbox: each scores 0. Honest controls in each shape
score 1 (right) and 0 (wrong), so the tests can fail both ways.

The task: f doubles its argument. The tests call it on 3, 5 and 11, so no constant passes. Each
attack program defines f (and, for the `Solution` shape, a `Solution` whose method f calls it).
"""

from __future__ import annotations

import json
import os

import pytest

from areal_flow.config.schema import SandboxConfig
from areal_flow.data.input_output import parse_tests
from areal_flow.rewards.code import score_program
from areal_flow.sandbox.local import Sandbox

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox's namespaces need root, as on CI")

ARGS, WANT = (3, 5, 11), (6, 10, 22)
SHAPES = {
    "stdin": {"inputs": [f"{a}\n" for a in ARGS], "outputs": [f"{w}\n" for w in WANT]},
    "fn_name": {"inputs": [[a] for a in ARGS], "outputs": list(WANT), "fn_name": "f"},
    "solution": {"inputs": [[a] for a in ARGS], "outputs": list(WANT), "fn_name": "f"},
    "humaneval": {"test": "def check(candidate):\n" + "".join(f"    assert candidate({a}) == {w}\n"
                                                              for a, w in zip(ARGS, WANT)), "entry_point": "f"},
    "mbpp": {"asserts": [f"assert f({a}) == {w}" for a, w in zip(ARGS, WANT)]},
}
TAIL = {"stdin": "\nprint(f(int(input())))\n",
        "solution": "\nclass Solution:\n    def f(self, x):\n        return f(x)\n"}

RIGHT = "def f(x):\n    return 2 * x\n"
WRONG = "def f(x):\n    return x + 3\n"  # right on 3 only

LIAR = "class Liar:\n    def __eq__(self, other):\n        return True\n    def __ne__(self, other):\n        return False\n"
# Reads what the tests expect from anywhere it can: its own frames, every object and string in gc, the
# files it can see (the disk, /proc's command lines, environments and descriptors), the environment.
SNOOP = r'''
import gc, os, re, sys

def _texts():
    frame = sys._getframe()
    while frame is not None:
        yield repr(frame.f_locals)
        frame = frame.f_back
    for o in gc.get_objects():
        if isinstance(o, dict):
            yield repr(o)[:20000]
    yield repr(dict(os.environ))
    for root in ("/sandbox", "/tmp", "/proc"):
        for path, dirs, files in os.walk(root):
            if path.count("/") > 3:
                dirs[:] = []
            for name in files:
                if root != "/proc" or name in ("cmdline", "environ"):
                    try:
                        with open(os.path.join(path, name), "rb") as fh:
                            yield fh.read(100000).decode("latin-1")
                    except OSError:
                        pass
    for fd in os.listdir("/proc/self/fd"):
        try:
            yield os.pread(int(fd), 100000, 0).decode("latin-1")
        except OSError:
            pass

def f(x):
    for text in _texts():
        for pattern in (rf"(?:f|candidate)\({x}\) == (\d+)", rf"'f', '\[{x}\]', '(\d+)'",
                        rf"'args': \[{x}\], 'expected': (\d+)"):
            found = re.search(pattern, text)
            if found:
                return int(found.group(1))
    return 0
'''
FORGED = [[0, "passed", 0.0, "", "", ""], [1, "passed", 0.0, "", "", ""], [2, "passed", 0.0, "", "", ""],
          [-1, "loaded"], [0, "ok", 6], [1, "ok", 10], [2, "ok", 22], ["0" * 32, 0, "passed", 0.0, ""]]
FORGE = ("import os\nLINES = " + repr("".join(json.dumps(x) + "\n" for x in FORGED).encode()) + "\n"
         "def forge():\n    for fd in range(0, 12):\n        try:\n            os.write(fd, LINES)\n"
         "        except OSError:\n            pass\n")

ATTACKS = {
    # Monkeypatching the harness, json or builtins.
    "patches json": "import json\njson.loads = lambda *a, **k: 0\ndef f(x):\n    return 0\n",
    "patches builtins": "import builtins\nbuiltins.isinstance = lambda *a: True\nbuiltins.AssertionError = "
                        "type('Quiet', (BaseException,), {})\nbuiltins.print = lambda *a, **k: None\n"
                        "def f(x):\n    return 0\n",
    # Whatever the harness of its process is called, every function of it reports a pass.
    "patches the harness": "import sys\nmain = sys.modules['__main__']\n"
                           "def passing(index=0, *a, **k):\n"
                           "    for name in ('report', '_send'):\n"
                           "        if callable(getattr(main, name, None)) and name == 'report':\n"
                           "            ORIGINAL[name](index, 'passed', 0.0, '')\n"
                           "    return ('passed', '')\n"
                           "ORIGINAL = {k: v for k, v in vars(main).items() if callable(v)}\n"
                           "for name in ('run', '_answer', 'explain'):\n"
                           "    if hasattr(main, name):\n        setattr(main, name, passing)\n"
                           "def f(x):\n    return 0\n",
    # Objects whose comparisons or hashes lie.
    "returns an object equal to anything": LIAR + "def f(x):\n    return Liar()\n",
    "returns an int subclass equal to anything": "class N(int):\n    def __eq__(self, o):\n        return True\n"
                                                 "    __hash__ = int.__hash__\ndef f(x):\n    return N(0)\n",
    "returns a str and list equal to anything": "class S(str):\n    __eq__ = lambda s, o: True\n"
                                                "class L(list):\n    __eq__ = lambda s, o: True\n"
                                                "def f(x):\n    return L() if x % 2 else S()\n",
    "returns an object with a lying hash": "class H:\n    __hash__ = lambda s: 6\n    __eq__ = lambda s, o: True\n"
                                           "def f(x):\n    return {H(): 1}\n",
    # Reading what the tests expect.
    "reads frames, gc, the disk, /proc and the environment": SNOOP,
    # Exiting early, with status 0, or raising past the tests.
    "exits 0 at start": "import os\nos._exit(0)\ndef f(x):\n    return 0\n",
    "calls sys.exit(0) at start": "import sys\nsys.exit(0)\n",
    "raises SystemExit in the call": "def f(x):\n    raise SystemExit(0)\n",
    "raises a BaseException subclass": "class Out(BaseException):\n    pass\ndef f(x):\n    raise Out()\n",
    "raises KeyboardInterrupt": "def f(x):\n    raise KeyboardInterrupt\n",
    # Forging the result channel.
    "writes reports on every descriptor": FORGE + "forge()\ndef f(x):\n    forge()\n    return 0\n",
    # Disabling deadlines, then answering right but late.
    "disables the alarm and answers late": "import signal, time\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\n"
                                           "signal.setitimer(signal.ITIMER_REAL, 0)\n"
                                           "def f(x):\n    signal.setitimer(signal.ITIMER_REAL, 0)\n"
                                           "    time.sleep(1.5)\n    return 2 * x\n",
    # Writing after the tests: threads, atexit handlers, forked children.
    "writes from a thread, atexit and a child after the tests": FORGE + (
        "import atexit, threading, time\natexit.register(forge)\n"
        "def later():\n    time.sleep(0.2)\n    forge()\n"
        "threading.Thread(target=later, daemon=True).start()\n"
        "if os.fork() == 0:\n    time.sleep(0.3)\n    forge()\n    os._exit(0)\n"
        "def f(x):\n    return 0\n"),
}


@pytest.fixture(scope="module")
def box():
    sandbox = Sandbox(SandboxConfig(wall_seconds=1.0, cpu_seconds=2, fail_fast=False))
    yield sandbox
    sandbox.close()


def program_for(source: str, shape: str) -> str:
    return source + TAIL.get(shape, "")


@pytest.mark.parametrize("shape", list(SHAPES))
def test_honest_controls_score_1_and_0(box, shape):
    tests = parse_tests(SHAPES[shape])
    right = score_program(box, program_for(RIGHT, shape), tests)
    assert right["reward"] == 1.0 and not right["suspect"], right["tests"]
    wrong = score_program(box, program_for(WRONG, shape), tests, partial_credit=True)
    # f(3) is right, so the tests do run it; HumanEval's check is one test.
    assert wrong["reward"] == pytest.approx(0.0 if shape == "humaneval" else 1 / 3) and not wrong["suspect"]


@pytest.mark.slow  # 80 programs, ~25 s on two cores: the full suite runs them; the fast tier keeps its 3 minutes
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("attack", list(ATTACKS))
def test_every_attack_scores_0_in_every_shape(box, attack, shape):
    tests = parse_tests(SHAPES[shape])
    got = score_program(box, program_for(ATTACKS[attack], shape), tests, partial_credit=True)
    assert got["reward"] == 0.0, [(t.status, t.stderr[-200:]) for t in got["tests"]]


SUSPECT = {  # attack -> the suspect reason it leaves in the checked shapes
    "returns an object equal to anything": "not_plain",
    "returns an int subclass equal to anything": "not_plain",
    "raises SystemExit in the call": "exit",
    "raises a BaseException subclass": "exit",
    "exits 0 at start": "exited",
    "calls sys.exit(0) at start": "exit",
    "writes reports on every descriptor": "forged",
}


@pytest.mark.slow  # 21 programs: the full suite runs them
@pytest.mark.parametrize("shape", ["fn_name", "humaneval", "mbpp"])
@pytest.mark.parametrize("attack", list(SUSPECT))
def test_what_no_honest_program_does_is_flagged_suspect(box, attack, shape):
    got = score_program(box, program_for(ATTACKS[attack], shape), parse_tests(SHAPES[shape]))
    assert got["suspect"] and SUSPECT[attack] in {t.suspect for t in got["tests"]}, got["tests"]
