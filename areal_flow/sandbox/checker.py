"""The checker: runs a program's tests in a process of its own, where the program cannot reach.

The sandbox's init forks it beside the program's process (areal_flow/sandbox/serve.py) in the same
namespaces, as a uid of its own: the program can neither signal nor trace it, nor read its memory or
descriptors. It holds the tests and what they expect; the program never does. A test reaches the
program only through calls: `candidate` in HumanEval's check(candidate), every other name a test
uses that neither the test, its setup nor the standard library defines (MBPP's `f` in
`assert f(1) == 2`), and the function of a function-call test. Each call sends its arguments over a
pipe and gets back plain data (areal_flow/sandbox/plain.py) or the exception the call raised, so no
object of the program's is ever compared, hashed or called here.

It reports on its stdout, which only it holds, one line per test as it starts, `[i]`, and as it ends,
`[i, status, seconds, error, got, suspect]` (i = -1: the program's own start). Statuses: passed,
wrong_answer (a failing assert or value), runtime_error, memory_limit, timeout (its own deadline per
test, which the program cannot touch), output_limit (a reply past the output cap), not_plain (a
result that is not plain data, or a reply that is not a reply) and not_run. `got` is what a
function-call test's call returned (its repr) or raised; `suspect` names what no honest program does:
not_plain, forged (a reply out of turn or malformed), exit (SystemExit or another BaseException from
a call or at load). A program whose process ends mid-test leaves the test started and not ended:
the host gives it the process's status (areal_flow/sandbox/asserts.py: `settle`).

Standard library only: bundled with plain.py into the source the init runs (`asserts.bundle`).
"""

import ast
import builtins
import json
import linecache
import os
import signal
import sys
import time
import traceback

from areal_flow.sandbox.plain import NotPlain, from_json, to_json  # bundled

LOAD = -1  # the index of the program's own start in the reports


class Deadline(BaseException):
    """A test's time ran out (a BaseException: a test's `except Exception` does not catch it)."""


class ProgramGone(BaseException):
    """The program's process closed its end: it exited or was killed mid-test."""


class Refused(Exception):
    """A reply that fails the test whatever the test does: its status and suspect say why."""

    def __init__(self, status, message, suspect=""):
        super().__init__(message)
        self.status, self.suspect = status, suspect


class ProgramError(RuntimeError):
    """An exception the program raised that is not a builtin one, by name."""


class Program:
    """The program's process, seen through its two pipes."""

    def __init__(self, requests, replies, max_reply):
        self.requests, self.replies, self.max_reply = requests, replies, max_reply
        self.buffer, self.next_id = b"", 0
        self.suspect = ""  # set when a call raised what only a program that wants out raises

    def receive(self):
        """The next reply line, decoded as JSON; ProgramGone at the end of the pipe."""
        while b"\n" not in self.buffer:
            if len(self.buffer) > self.max_reply:
                raise Refused("output_limit", f"a reply longer than {self.max_reply} bytes")
            chunk = os.read(self.replies, 1 << 16)
            if not chunk:
                raise ProgramGone
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        try:
            reply = json.loads(line)
        except (ValueError, RecursionError):
            reply = None
        if type(reply) is not list or not reply:
            raise Refused("not_plain", "a reply that is not one", "forged")
        return reply

    def loaded(self):
        """None when the program started, else (its exception's type, the traceback)."""
        reply = self.receive()
        if reply[0] != LOAD or reply[1:2] not in (["loaded"], ["failed"]):
            raise Refused("not_plain", "a reply out of turn", "forged")
        return None if reply[1] == "loaded" else (str(reply[2]), str(reply[3]))

    def call(self, name, args, kwargs, method_first=False):
        """What the program's `name(*args, **kwargs)` returned, as plain data; raises what it raised."""
        request_id, self.next_id = self.next_id, self.next_id + 1
        line = json.dumps([request_id, name, to_json(list(args)), to_json(dict(kwargs)), method_first])
        try:
            os.write(self.requests, line.encode() + b"\n")
        except BrokenPipeError:
            raise ProgramGone from None
        reply = self.receive()
        if reply[0] != request_id or len(reply) < 2:
            raise Refused("not_plain", "a reply out of turn", "forged")
        kind = reply[1]
        if kind == "ok" and len(reply) == 3:
            try:
                return from_json(reply[2])
            except NotPlain as e:
                raise Refused("not_plain", f"{name}(...) sent {e}", "forged") from None
        if kind == "not_plain" and len(reply) == 3:
            raise Refused("not_plain", f"{name}(...) returned {reply[2]}, which is not plain data", "not_plain")
        if kind == "raised" and len(reply) == 5:
            raise self._exception(str(reply[2]), str(reply[3]), reply[4] is True)
        raise Refused("not_plain", "a reply that is not one", "forged")

    def _exception(self, kind, message, is_exception):
        """The exception a call raised, as one of ours: a builtin Exception by its name (a test may
        expect a ValueError), anything else a ProgramError."""
        if not is_exception:
            self.suspect = "exit"
        cls = getattr(builtins, kind, None)
        if is_exception and isinstance(cls, type) and issubclass(cls, Exception):
            try:
                return cls(message)
            except Exception:  # noqa: BLE001 - an exception class that wants other arguments
                pass
        return ProgramError(f"{kind}: {message}")


class Remote:
    """A name the program defines, as a test sees it: calling it calls the program's."""

    def __init__(self, program, name):
        self._program, self._name = program, name

    def __call__(self, *args, **kwargs):
        try:
            return self._program.call(self._name, args, kwargs)
        except NotPlain as e:
            raise Refused("runtime_error", f"an argument of {self._name}(...) is not plain data: {e}") from None

    def __repr__(self):
        return f"<the program's {self._name}>"


def free_names(source):
    """The names `source` reads: each is bound before it runs, to what the setup or the standard
    library defines, else to the program's (a local of the test shadows it)."""
    return {node.id for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Name)}


NOT_IMPORTED = ("this", "antigravity", "idlelib", "tkinter", "turtle")  # modules that print or open windows


def bind(scope, source, program):
    for name in free_names(source) - scope.keys() - set(dir(builtins)):
        if name in sys.stdlib_module_names and name not in NOT_IMPORTED:
            scope[name] = __import__(name)
        else:
            scope[name] = Remote(program, name)


def compare_call(got, expected, name):
    """A function-call test's verdict on a returned value: (passed, message). The value is compared
    after a JSON round trip (tuples become lists, as they would reaching another process); an
    expected value wrapped in a one-element list (APPS) matches its content too."""
    try:
        got = json.loads(json.dumps(got))
    except (TypeError, ValueError) as e:
        raise Refused("runtime_error", f"{name}(...) returned {type(got).__name__}, which JSON cannot encode: {e}") \
            from None
    same = got == expected or (type(expected) is list and len(expected) == 1 and got == expected[0])
    return same, f"{name}(...) returned {json.dumps(got)[:200]}, expected {json.dumps(expected)[:200]}"


class Checker:
    """Runs the job's tests against `program`, reporting each on `out`."""

    def __init__(self, job, program, out):
        self.job, self.program, self.out = job, program, out
        self.scope = {"__name__": "__check__"}
        self.start = 0.0

    def report(self, *fields):
        self.out.write(json.dumps(list(fields)) + "\n")
        self.out.flush()

    def explain(self, e, source, name):
        """The traceback's tail, showing the test's lines, without this module's frames."""
        linecache.cache[name] = (len(source), None, source.splitlines(True), name)
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != name:
            tb = tb.tb_next
        return "".join(traceback.format_exception(e, e, tb))[-self.job["error_chars"]:]

    def run_test(self, index, test):
        """One test's (status, error, got, suspect); raises ProgramGone and Deadline."""
        if "call" in test:
            name = test["call"]
            try:
                got = self.program.call(name, test["args"], {}, method_first=True)
            except Refused:
                raise
            except Exception as e:  # noqa: BLE001 - what the call raised is what it gave
                return "runtime_error", f"{type(e).__name__}: {e}", f"{type(e).__name__}: {e}", ""
            same, message = compare_call(got, test["expected"], name)
            return ("passed", "", "", "") if same else ("wrong_answer", message, repr(got), "")
        source, name = test["source"], f"test_{index}"
        try:
            bind(self.scope, source, self.program)
            exec(compile(source, name, "exec"), self.scope)
        except (Refused, ProgramGone, Deadline):
            raise
        except AssertionError as e:
            return "wrong_answer", self.explain(e, source, name), "", ""
        except BaseException as e:  # noqa: BLE001 - a test that fails in any other way
            status = "memory_limit" if isinstance(e, MemoryError) else "runtime_error"
            return status, self.explain(e, source, name), "", ""
        return "passed", "", "", ""

    def timed(self, index, run):
        """run() under this test's deadline: (status, error, got, suspect)."""
        self.report(index)
        self.start = time.monotonic()
        self.program.suspect = ""
        seconds = self.job["seconds"]  # None: replies recorded earlier (a remote sandbox's), no deadline here
        try:
            if seconds is not None:
                signal.setitimer(signal.ITIMER_REAL, seconds)
            try:
                status, error, got, suspect = run()
            finally:
                if seconds is not None:
                    signal.setitimer(signal.ITIMER_REAL, 0)
        except Deadline:
            status, error, got, suspect = "timeout", f"past {self.job['seconds']} s", "timeout", ""
        except Refused as e:
            status, error, got, suspect = e.status, str(e), str(e), e.suspect
        outcome = (status, time.monotonic() - self.start, error, got, suspect or self.program.suspect)
        self.report(index, *outcome)
        return outcome

    def load(self):
        """Wait for the program to start, then run the setup here; the LOAD status."""
        def run():
            failed = self.program.loaded()
            if failed is not None:
                kind, text = failed
                status = "memory_limit" if kind == "MemoryError" else "runtime_error"
                suspect = "" if kind in dir(builtins) and issubclass(getattr(builtins, kind), Exception) else "exit"
                return status, text, kind, suspect
            setup = self.job["setup"]
            if setup:
                bind(self.scope, setup, self.program)
                exec(compile(setup, "setup", "exec"), self.scope)
            return "passed", "", "", ""
        return self.timed(LOAD, run)

    def run(self):
        tests, fail_fast = self.job["tests"], self.job["fail_fast"]
        started, _, error, got, suspect = self.load()
        for i, test in enumerate(tests):
            if started != "passed":  # the program did not start: every test fails alike
                self.report(i, started if i == 0 or not fail_fast else "not_run", 0.0, error, got, suspect)
                continue
            status = self.timed(i, lambda: self.run_test(i, test))[0]
            if status in ("timeout", "output_limit") or (fail_fast and status not in ("passed", "wrong_answer")):
                # A program that outran its deadline is still running; the host starts a new one for the rest.
                for j in range(i + 1, len(tests)):
                    if fail_fast:
                        self.report(j, "not_run", 0.0, "", "", "")
                return


def check(job, program, out):
    """Run the job's tests against `program`, reporting on `out`."""
    try:
        Checker(job, program, out).run()
    except (ProgramGone, Deadline):
        pass  # the test that was running is started, not ended: the host gives it the process's status
    out.flush()


def main(job):
    def alarm(signum, frame):
        raise Deadline
    signal.signal(signal.SIGALRM, alarm)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what a test prints (a value the program returned, say) can never pass for a report
    check(job, Program(3, 4, job["max_reply"]), out)

