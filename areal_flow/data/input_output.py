"""The `input_output` field of AReaL's code data (from APPS and LiveCodeBench): a problem's tests.

    {"inputs": [...], "outputs": [...], "fn_name": optional}

Without `fn_name` each input is a program's stdin (a string, or a list of lines) and each output
the expected stdout. With `fn_name` the program defines that function (or a method of
`class Solution`) and each input is its arguments: a list (APPS), or a string with one JSON value
per line (LiveCodeBench); each output is the expected return value (a JSON text or a value).

One reader for both places that need it: the dataset loader checks every row at start (an error
names the file and line), and the code reward reads the tests it runs.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any


@dataclasses.dataclass(frozen=True)
class Tests:
    """A problem's tests: per case the text handed to the sandbox and the expected output."""

    inputs: list[str]  # stdin text, or (fn_name) the JSON list of arguments
    outputs: list[Any]  # expected stdout text, or (fn_name) the expected value
    fn_name: str | None = None


def parse_tests(input_output: str | dict) -> Tests:
    """Read the field (JSON text or its object). Raises ValueError saying what is wrong, starting
    `input_output: `."""
    spec = input_output
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"input_output: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(spec, dict):
        raise ValueError(f"input_output: expected an object with 'inputs' and 'outputs', got {type(spec).__name__}")
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
    # A Parquet struct column gives rows without fn_name a null: that is the same as absent.
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
