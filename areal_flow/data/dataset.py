"""Prompt datasets: JSONL, Parquet and `datasets.save_to_disk` directories, with errors that
point at the line (JSONL) or row (the others).

Every row comes back as `dict[str, str]` with an `id`, so samples can carry a stable prompt id for
provenance. Lists and objects become JSON text, which a reward function can parse back.

A row format decides what a row must hold and where its id comes from:
- `jsonl` (generic): the fields asked for; the id is the row's own `"id"`, else `"{stem}:{n}"`.
- `areal_math` (AReaL's math rows): `query_id` (the id), `prompt`, `solutions`, a non-empty list
  of reference answers.
- `areal_code` (AReaL's code rows, the LiveCodeBench/APPS shape): `query_id`, `prompt`,
  `input_output`, an object (or its JSON text) with `inputs` and `outputs`, non-empty lists of the
  same length, and an optional `fn_name` string; or assert-style tests, `{test, entry_point}` or
  `{asserts}` (areal_flow/data/input_output.py), which must be able to tell a right program from
  an empty one (`input_output.degenerate`: not every expected output blank, or None; some assert).
Where the fields name `input_output` (always for `areal_code`), a row without it but with
HumanEval's `test` and `entry_point`, or `asserts` (MBPP's `test_list`), gets it from them, so the
code reward reads one field whatever the row's shape; a row with none of these is refused.
The reader is chosen by the path, whatever the format: a `.jsonl` file, a `.parquet` file, or a
directory written by `datasets` (`Dataset` or `DatasetDict`, whose `split` is then chosen).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from areal_flow.data.input_output import degenerate, parse_tests, row_tests

FORMATS = ("jsonl", "areal_math", "areal_code")
INSTALL_HINT = "pip install -e '.[data]'"


class DatasetError(ValueError):
    """A dataset that cannot be used; the message names the file and, where known, the line or row."""


def _to_str(value: object) -> str:
    # Numbers become their plain text ("4690"); nested values keep JSON syntax rather than
    # Python's repr, so they can be parsed back.
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, list, bool)):
        return json.dumps(value)
    return str(value)


# ---- readers: (where, place, object) for every row; `place` is what a duplicate id points back to ----


def _jsonl_rows(path: str) -> Iterator[tuple[str, str, Any]]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DatasetError(f"{where}: not valid UTF-8 ({e.reason})") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            yield where, f"line {lineno}", obj


def _missing(package: str, path: str, what: str) -> DatasetError:
    return DatasetError(f"{path}: reading {what} needs the optional package {package!r}, which is not "
                        f"installed: {INSTALL_HINT}")


def _parquet_rows(path: str) -> Iterator[tuple[str, str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise _missing("pyarrow", path, "Parquet files") from None
    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=1024)
        n = 0
        for batch in batches:
            for obj in batch.to_pylist():
                # Rows count from 0, as `table.slice(n, 1)` and pandas' `iloc[n]` do.
                yield f"{path}: row {n}", f"row {n}", obj
                n += 1
    except Exception as e:  # pyarrow's errors share no base class worth naming
        raise DatasetError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from None


def _saved_dataset_rows(path: str, split: str | None) -> Iterator[tuple[str, str, Any]]:
    try:
        import datasets
    except ImportError:
        raise _missing("datasets", path, "directories saved by datasets") from None
    folder = path
    splits_file = os.path.join(path, "dataset_dict.json")
    if os.path.isfile(splits_file):
        # A DatasetDict is a folder per split beside the list of them: read the one asked for.
        try:
            with open(splits_file) as f:
                splits = list(json.load(f)["splits"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DatasetError(f"{splits_file}: not a DatasetDict's list of splits ({e})") from None
        if split not in splits:
            raise DatasetError(f"{path}: a DatasetDict with no split {split!r} (it has: {', '.join(splits) or 'none'})")
        folder = os.path.join(path, split)
    # load_from_disk fails with an IndexError on a dataset saved with no rows (it has no data
    # files): such a dataset is empty, and is reported as that.
    try:
        with open(os.path.join(folder, "state.json")) as f:
            if json.load(f).get("_data_files") == []:
                return
    except (OSError, ValueError, AttributeError):
        pass  # load_from_disk below says what is wrong
    try:
        ds = datasets.load_from_disk(folder)
    except Exception as e:  # a damaged folder fails in many ways (JSON, Arrow, missing files): all mean unreadable
        raise DatasetError(f"{folder}: not readable by datasets.load_from_disk ({type(e).__name__}: {e})") from None
    for n, obj in enumerate(ds):
        # Rows count from 0, as `ds[n]` does; a DatasetDict's rows are named by their split's folder.
        yield f"{folder}: row {n}", f"row {n}", obj


def _reader(path: str, split: str | None) -> Iterator[tuple[str, str, Any]]:
    if not os.path.exists(path):
        raise DatasetError(f"{path}: dataset file does not exist")
    if os.path.isdir(path):
        if not any(os.path.isfile(os.path.join(path, f)) for f in ("dataset_dict.json", "state.json")):
            raise DatasetError(f"{path}: a directory, but not one written by datasets' save_to_disk "
                               "(no dataset_dict.json or state.json)")
        return _saved_dataset_rows(path, split)
    if path.endswith(".parquet"):
        return _parquet_rows(path)
    if path.endswith(".jsonl"):
        return _jsonl_rows(path)
    raise DatasetError(f"{path}: unknown dataset type; expected a .jsonl file, a .parquet file or a "
                       "directory saved by datasets")


# ---- per-format row checks: each returns what is wrong, prefixed by the field, or None ----------


def _check_solutions(value: Any) -> str | None:
    if not isinstance(value, list):
        return f"solutions: expected a list of answer strings, got {type(value).__name__}"
    if not value:
        return "solutions: the list is empty"
    for i, item in enumerate(value):
        if not isinstance(item, str):
            return f"solutions: item {i} is {type(item).__name__}, expected a string"
        if not item.strip():
            return f"solutions: item {i} is an empty string"
    return None


def _check_input_output(value: Any) -> str | None:
    try:
        tests = parse_tests(value)
    except ValueError as e:
        return str(e)
    if reason := degenerate(tests):
        return f"input_output: {reason}"
    return None


def _tests_from_row(obj: dict, where: str) -> None:
    """Give a code row without `input_output` the field, from its assert-style tests."""
    try:
        spec = row_tests(obj)
    except ValueError as e:
        raise DatasetError(f"{where}: {e}") from None
    if spec is None:
        has = ", ".join(k for k, v in obj.items() if v is not None) or "no fields"  # a Parquet row's nulls are absent
        raise DatasetError(f"{where}: missing field 'input_output', and no assert-style tests to take it from "
                           f"('test' with 'entry_point', 'asserts' or 'test_list') (row has: {has})")
    if reason := degenerate(parse_tests(spec)):
        key = next(k for k in ("test", "asserts", "test_list") if obj.get(k) is not None)  # as row_tests reads it
        raise DatasetError(f"{where}: {key}: {reason}")
    obj["input_output"] = spec


def _check_prompt(value: Any) -> str | None:
    if not isinstance(value, str):
        return f"prompt: expected a string, got {type(value).__name__}"
    return None


# format -> (id field or None, fields it needs, checks by field)
_FORMATS: dict[str, tuple[str | None, tuple[str, ...], dict[str, Callable[[Any], str | None]]]] = {
    "jsonl": (None, (), {}),
    "areal_math": ("query_id", ("query_id", "prompt", "solutions"),
                   {"prompt": _check_prompt, "solutions": _check_solutions}),
    "areal_code": ("query_id", ("query_id", "prompt", "input_output"),
                   {"prompt": _check_prompt, "input_output": _check_input_output}),
}


def load_rows(path: str, required: Sequence[str], fmt: str = "jsonl", split: str | None = "train",
              places: list[str] | None = None) -> list[dict[str, str]]:
    """Load the rows of a dataset of row format `fmt` (see the module's doc); each must have the
    fields `required` beside the format's own. `split` picks the split of a DatasetDict directory.
    `places`, when given, gets each row's place for errors found later ("file:line", "file: row n").

    Raises `DatasetError` for a missing path, an unknown file type, an empty dataset, a row that
    is not an object, a row missing a field (or with it null), a row the format refuses, and two
    rows with the same id. JSONL blank lines are skipped (a trailing newline is common).
    """
    if fmt not in _FORMATS:
        raise DatasetError(f"unknown dataset format {fmt!r}; expected one of {', '.join(FORMATS)}")
    return _collect(path, _reader(path, split), required, fmt, places)


def load_jsonl(path: str, required: Sequence[str]) -> list[dict[str, str]]:
    """Load a generic JSONL file, whatever its suffix, whose rows must each have the fields `required`."""
    if not os.path.exists(path):
        raise DatasetError(f"{path}: dataset file does not exist")
    if not os.path.isfile(path):
        raise DatasetError(f"{path}: dataset path is not a file")
    return _collect(path, _jsonl_rows(path), required, "jsonl")


def _collect(path: str, objects: Iterator[tuple[str, str, Any]], required: Sequence[str], fmt: str,
             places: list[str] | None = None) -> list[dict[str, str]]:
    id_field, own, checks = _FORMATS[fmt]
    fields = list(dict.fromkeys([*own, *required]))
    code = "input_output" in fields  # the code reward's tests: checked, and taken from assert-style rows
    if code:
        checks = {**checks, "input_output": _check_input_output}
    stem = os.path.splitext(os.path.basename(os.path.normpath(path)))[0]
    rows: list[dict[str, str]] = []
    id_place: dict[str, str] = {}
    for where, place, obj in objects:
        if not isinstance(obj, dict):
            raise DatasetError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        if code and obj.get("input_output") is None:
            _tests_from_row(obj, where)
        for field in fields:
            if field not in obj:
                has = ", ".join(obj) or "no fields"
                raise DatasetError(f"{where}: missing field {field!r} (row has: {has})")
            if obj[field] is None:
                raise DatasetError(f"{where}: field {field!r} is null")
        for field, check in checks.items():
            if problem := check(obj[field]):
                raise DatasetError(f"{where}: {problem}")
        row = {k: _to_str(v) for k, v in obj.items() if v is not None}
        # place is "line N" or "row N": the default id keeps the number only, e.g. "prompts:3".
        row_id = row[id_field] if id_field else row.get("id", f"{stem}:{place.split()[-1]}")
        row["id"] = row_id
        if row_id in id_place:
            raise DatasetError(f"{where}: duplicate id {row_id!r} (first used on {id_place[row_id]})")
        id_place[row_id] = place
        rows.append(row)
        if places is not None:
            places.append(where)
    if not rows:
        raise DatasetError(f"{path}: dataset is empty (no rows)")
    return rows
