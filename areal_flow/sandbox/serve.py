"""The program's side of a checked run: this script is the process a model's program runs in when
its tests are checks (function calls, HumanEval's check(candidate), MBPP's asserts).

It loads the program from solution.py (as a module that is not __main__; its prints go to stderr),
says so, then answers calls, one line each way. Requests come in on descriptor 3 and replies go out
on descriptor 4, both pipes to the checker, a process of another uid that runs the tests
(areal_flow/sandbox/checker.py). Nothing here knows what a test expects: the checker sends only a
call's name and arguments, and gets back what the call returned as plain data
(areal_flow/sandbox/plain.py) or the exception it raised.

    request  [id, name, args, kwargs, method_first]     args/kwargs encoded as plain data
    reply    [id, "ok", value] | [id, "raised", type, message, is_exception] | [id, "not_plain", what]
    load     [-1, "loaded"] | [-1, "failed", type, traceback]

Where descriptor 3 is not open (a remote sandbox runs one process, with no checker beside it), the
requests come on stdin and the replies go out on stdout, and the host checks them afterwards.

The program shares this process and can rewrite any of it. That buys it nothing: the checker reads
replies as plain data only, and a forged, late or missing reply fails the test.

Standard library only: bundled with plain.py into the script the sandbox runs (`asserts.bundle`).
"""

import json
import os
import sys

from areal_flow.sandbox.plain import NotPlain, from_json, to_json  # bundled

ERROR_CHARS = 500  # the tail of a traceback, or the head of an exception's message, that is sent


def _send(out, *fields):
    out.write(json.dumps(list(fields), allow_nan=True, separators=(",", ":")).encode() + b"\n")
    out.flush()


def _load(scope):
    """Run solution.py in `scope`; None, or (the exception's type, the traceback's tail)."""
    try:
        with open("solution.py") as f:
            source = f.read()
        exec(compile(source, "solution.py", "exec"), scope)
    except BaseException as e:  # noqa: BLE001 - whatever stops the program, the checker hears of it
        import traceback
        text = "".join(traceback.format_exception(e, e, e.__traceback__.tb_next))
        return type(e).__name__, text[-ERROR_CHARS:]
    return None


def _lookup(scope, name, method_first):
    """A function the program defines: a method of a new `Solution()` first when asked (LeetCode's
    shape), else a global."""
    cls = scope.get("Solution")
    if method_first and isinstance(cls, type) and hasattr(cls, name):
        return getattr(cls(), name)
    if name not in scope:
        raise NameError(f"name {name!r} is not defined")
    return scope[name]


def _answer(scope, request):
    """The reply's fields after its id."""
    try:
        name, args, kwargs, method_first = request
        value = _lookup(scope, name, method_first)(*from_json(args), **from_json(kwargs))
    except BaseException as e:  # noqa: BLE001 - the checker decides what an exception means
        return ["raised", type(e).__name__, str(e)[:ERROR_CHARS], isinstance(e, Exception)]
    try:
        return ["ok", to_json(value)]
    except NotPlain as e:
        return ["not_plain", str(e)]


def main():
    try:
        requests, replies = os.fdopen(3, "rb"), os.fdopen(4, "wb")
    except OSError:  # a remote sandbox's one process: the calls on stdin, the replies on stdout
        requests, replies = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(2, 1)  # the program's prints are for the reader of its stderr, never a reply
    scope = {"__name__": "solution"}
    failed = _load(scope)
    if failed is not None:
        _send(replies, -1, "failed", *failed)
        return
    _send(replies, -1, "loaded")
    for line in requests:
        request_id, *request = json.loads(line)
        _send(replies, request_id, *_answer(scope, request))


if __name__ == "__main__":
    main()
    sys.stdout.flush()
