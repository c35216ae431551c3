"""A problem's tests, in the shapes code data comes in; the code reward runs either shape.

`input_output`, from AReaL's code data (APPS and LiveCodeBench):

    {"inputs": [...], "outputs": [...], "fn_name": optional}

Without `fn_name` each input is a program's stdin (a string, or a list of lines) and each output
the expected stdout. With `fn_name` the program defines that function (or a method of
`class Solution`) and each input is its arguments: a list (APPS), or a string with one JSON value
per line (LiveCodeBench); each output is the expected return value (a JSON text or a value).

Assert-style, the shape of HumanEval, MBPP and most code-RL data: Python run after the program, in
its namespace, that passes when it raises nothing.

    {"test": "def check(candidate): ...", "entry_point": "name", "setup": optional}
                                                                   one test: check(name) (HumanEval)
    {"asserts": ["assert f(1) == 2", ...], "setup": optional}       one test per item (MBPP's test_list)

A dataset row without `input_output` but with HumanEval's `test`/`entry_point`, or `asserts` (MBPP's
`test_list`), gets the field in the assert-style shape from `row_tests`, so the graph's reward
node reads one field whatever shape its rows hold.

One reader for both places that need it: the dataset loader checks every row at start (an error
names the file and line), and the code reward reads the tests it runs.

`degenerate` says why tests that parse cannot tell a right program from an empty one, the loader
refusing such rows: stdin tests whose every expected output is blank (a program that prints nothing
passes), function-call tests whose every expected value is None or APPS's `[None]` (a function whose
body is `pass` passes), assert-style tests with no `assert`, no `raise` and no call of an `assert*`
function (unittest's `assertEqual`, numpy's `assert_allclose`) in any check or the setup: nothing
in them is meant to fail, so a program that returns anything of the right type passes.
"""

from __future__ import annotations

import ast
import dataclasses
import json
from typing import Any, Union


@dataclasses.dataclass(frozen=True)
class Tests:
    """A problem's tests: per case the text handed to the sandbox and the expected output."""

    inputs: list[str]  # stdin text, or (fn_name) the JSON list of arguments
    outputs: list[Any]  # expected stdout text, or (fn_name) the expected value
    fn_name: str | None = None

    def __len__(self) -> int:
        return len(self.inputs)


@dataclasses.dataclass(frozen=True)
class AssertTests:
    """Assert-style tests: each of `checks` is Python source run after `setup`, in their namespace,
    where every name neither defines calls the program's (areal_flow/sandbox/checker.py); a test
    passes when its check raises nothing."""

    checks: list[str]
    # Run once, before the checks, beside them (never in the program's process): MBPP's
    # test_setup_code and test_imports, HumanEval's helpers from its prompt (poly, encode_cyclic).
    setup: str = ""

    def __len__(self) -> int:
        return len(self.checks)


AnyTests = Union[Tests, AssertTests]  # what parse_tests returns: the code reward runs either
SHAPES = "{inputs, outputs, fn_name?}, {test, entry_point} or {asserts, setup?}"


def parse_tests(input_output: str | dict) -> AnyTests:
    """Read the field (JSON text or its object) in any of its shapes. Raises ValueError saying what
    is wrong, starting `input_output: `."""
    spec = input_output
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"input_output: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(spec, dict):
        raise ValueError(f"input_output: expected an object, {SHAPES}; got {type(spec).__name__}")
    # A Parquet struct column holds every key of every shape, null where a row has none.
    spec = {k: v for k, v in spec.items() if v is not None}
    if "test" in spec or "entry_point" in spec:
        tests = _check_tests(spec.get("test"), spec.get("entry_point"), "input_output: 'test'",
                             "input_output: 'entry_point'")
        setup = spec.get("setup")
        if setup:
            _python(setup, "input_output: 'setup'")
        return AssertTests(tests.checks, setup or "")
    if "asserts" in spec:
        return _assert_tests(spec["asserts"], spec.get("setup"), "input_output: 'asserts'", "input_output: 'setup'")
    return _io_tests(spec)


def degenerate(tests: AnyTests) -> str | None:
    """Why `tests` (parsed) cannot tell a right program from an empty one, or None when they can.
    Conservative: a single case or check that can fail makes the tests usable."""
    if isinstance(tests, AssertTests):
        if any(_can_fail(source) for source in [*tests.checks, tests.setup] if source.strip()):
            return None
        return ("no assert statement, raise or assert*() call in any test: nothing checks the program's answers, "
                "so a function whose body is `pass` passes")
    if tests.fn_name is None:
        if all(not str(y).strip() for y in tests.outputs):
            return "every expected output is blank: a program that prints nothing passes every test"
        return None
    if all(y is None or y == [None] for y in tests.outputs):
        return (f"every expected output is None: a function {tests.fn_name}() whose body is `pass` "
                "passes every test")
    return None


def _can_fail(source: str) -> bool:
    """Whether Python `source` holds an assert statement, a raise, or a call of a function named
    assert* (unittest's assertEqual, numpy.testing's assert_allclose): something meant to fail."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return True  # not ours to judge here: parse_tests reports it
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assert, ast.Raise)):
            return True
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if name.lower().startswith("assert"):
                return True
    return False


def row_tests(row: dict) -> dict | None:
    """The assert-style tests of a dataset row, in the shape `input_output` holds them: HumanEval's
    `test` with `entry_point`, or `asserts` (MBPP's `test_list`, with its `test_setup_code` and
    `test_imports` as the setup); None when the row has none of these keys. Raises ValueError naming
    the row's key that is wrong."""
    if row.get("test") is not None:
        _check_tests(row["test"], row.get("entry_point"), "test", "entry_point")
        return {"test": row["test"], "entry_point": row["entry_point"]}
    key = next((k for k in ("asserts", "test_list") if row.get(k) is not None), None)  # MBPP's is test_list
    if key is None:
        return None
    imports = row.get("test_imports") or []
    setup = "\n".join([str(row.get("test_setup_code") or ""),
                       *(map(str, imports) if isinstance(imports, list) else [str(imports)])]).strip()
    _assert_tests(row[key], setup, key, "test_setup_code and test_imports")
    return {"asserts": row[key], **({"setup": setup} if setup else {})}


def _python(source: Any, what: str) -> ast.Module:
    """The syntax tree of `source` (nothing runs); ValueError naming `what` when it is not Python."""
    if not isinstance(source, str) or not source.strip():
        raise ValueError(f"{what}: expected Python source, got {source!r:.60}")
    try:
        return ast.parse(source)
    except (SyntaxError, ValueError) as e:  # ValueError: a NUL byte
        line = f" at line {e.lineno}" if isinstance(e, SyntaxError) else ""
        raise ValueError(f"{what}: not valid Python ({type(e).__name__}{line}: {getattr(e, 'msg', e)})") from None


def _check_tests(test: Any, entry_point: Any, test_key: str, entry_key: str) -> AssertTests:
    """HumanEval's shape: `test` defines check(candidate), called with the function `entry_point`."""
    if test is None:
        raise ValueError(f"{entry_key}: given without the test code that checks it ({test_key})")
    tree = _python(test, test_key)
    if not (isinstance(entry_point, str) and entry_point.isidentifier()):
        raise ValueError(f"{entry_key}: expected the name of the function the test checks (a Python identifier), "
                         f"got {entry_point!r}")
    if not any(isinstance(node, ast.FunctionDef) and node.name == "check" for node in tree.body):
        raise ValueError(f"{test_key}: defines no function check(candidate)")
    return AssertTests([f"{test}\ncheck({entry_point})\n"])


def _assert_tests(asserts: Any, setup: Any, key: str, setup_key: str) -> AssertTests:
    if not isinstance(asserts, list):
        raise ValueError(f"{key}: expected a list of assert statements, got {type(asserts).__name__}")
    if not asserts:
        raise ValueError(f"{key}: no tests (the list is empty)")
    for i, item in enumerate(asserts):
        _python(item, f"{key}[{i}]")
    if setup:
        _python(setup, setup_key)
    return AssertTests(list(asserts), setup or "")


def _io_tests(spec: dict) -> Tests:
    if "inputs" not in spec and "outputs" not in spec:
        raise ValueError(f"input_output: no tests in any shape: expected {SHAPES} (it has: {', '.join(spec) or 'nothing'})")
    for key in ("inputs", "outputs"):
        if key not in spec:
            raise ValueError(f"input_output: missing {key!r} (it has: {', '.join(spec) or 'nothing'})")
        if not isinstance(spec[key], list):
            raise ValueError(f"input_output: {key!r} is {type(spec[key]).__name__}, expected a list of test cases")
    inputs, outputs = spec["inputs"], spec["outputs"]
    if not inputs:
        raise ValueError("input_output: no test cases ('inputs' is empty)")
    if len(inputs) != len(outputs):
        raise ValueError(f"input_output: 'inputs' has {len(inputs)} cases, 'outputs' has {len(outputs)}")
    fn_name = spec.get("fn_name")
    if fn_name is None:
        return Tests([_text(x) for x in inputs], [_text(y) for y in outputs])
    if not (isinstance(fn_name, str) and fn_name.isidentifier()):
        raise ValueError(f"input_output: 'fn_name' must be a function name (a Python identifier), got {fn_name!r}")
    return Tests([json.dumps(_arguments(x, i)) for i, x in enumerate(inputs)], [_value(y) for y in outputs], fn_name)


def _text(x: Any) -> str:
    return "\n".join(map(str, x)) if isinstance(x, list) else str(x)


def _arguments(x: Any, i: int) -> list:
    if isinstance(x, list):
        return x
    try:
        return [json.loads(line) for line in str(x).splitlines() if line.strip()]
    except json.JSONDecodeError as e:
        raise ValueError(f"input_output: inputs[{i}] is not one JSON value per line ({e.msg})") from None


def _value(y: Any) -> Any:
    if isinstance(y, str):
        try:
            return json.loads(y)
        except json.JSONDecodeError:
            return y
    return json.loads(json.dumps(y))  # tuples become lists, as the program's JSON return value
