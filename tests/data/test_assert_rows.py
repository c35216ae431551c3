"""Code rows with assert-style tests (HumanEval's `test` + `entry_point`, `asserts`, MBPP's
`test_list`): the loader gives them the code reward's tests field, `input_output`, in the shape the
reward runs, and refuses a code row with no tests in any shape, naming its file and line (or row)."""

import json

import pytest

from areal_flow.data.dataset import DatasetError, load_rows
from areal_flow.data.input_output import AssertTests, parse_tests

CODE = ["prompt", "input_output"]
CHECK = "def check(candidate):\n    assert candidate(2) == 4\n"
HUMANEVAL = {"query_id": "he", "prompt": "def square(x):\n", "test": CHECK, "entry_point": "square"}
MBPP = {"query_id": "mbpp", "prompt": "Write f.", "test_list": ["assert f(1) == 2", "assert f(2) == 4"],
        "test_setup_code": "", "test_imports": ["import math"]}
ASSERTS = {"query_id": "asserts", "prompt": "Write f.", "asserts": ["assert f(0) == 0"]}
IO = {"query_id": "io", "prompt": "Add.", "input_output": {"inputs": ["1 2\n"], "outputs": ["3\n"]}}


def _jsonl(tmp_path, rows, name="code.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_every_shape_of_tests_reaches_the_tests_field(tmp_path):
    rows = load_rows(_jsonl(tmp_path, [HUMANEVAL, MBPP, ASSERTS, IO]), CODE, "areal_code")
    fields = [json.loads(r["input_output"]) for r in rows]
    assert fields == [{"test": CHECK, "entry_point": "square"},
                      {"asserts": MBPP["test_list"], "setup": "import math"},
                      {"asserts": ASSERTS["asserts"]},
                      IO["input_output"]]
    tests = [parse_tests(r["input_output"]) for r in rows]  # as the code reward reads them
    assert [type(t) is AssertTests for t in tests] == [True, True, True, False]
    assert [len(t) for t in tests] == [1, 2, 1, 1]
    assert rows[1]["test_list"] == json.dumps(MBPP["test_list"])  # the row's own keys stay


def test_generic_rows_get_the_field_when_the_dataset_fields_name_it(tmp_path):
    mbpp = {"task_id": 11, "text": "Write f.", "test_list": ["assert f(1) == 2"]}
    rows = load_rows(_jsonl(tmp_path, [mbpp]), ["text", "input_output"], "jsonl")
    assert json.loads(rows[0]["input_output"]) == {"asserts": ["assert f(1) == 2"]}
    # Rows whose fields do not name the tests field are generic rows: left as they are.
    plain = load_rows(_jsonl(tmp_path, [{"prompt": "p", "test": "not Python ("}], name="plain.jsonl"), ["prompt"])
    assert "input_output" not in plain[0]


@pytest.mark.parametrize("fmt, fields", [("areal_code", CODE), ("jsonl", ["prompt", "input_output"])])
def test_a_code_row_without_tests_is_refused_naming_file_and_line(tmp_path, fmt, fields):
    path = _jsonl(tmp_path, [ASSERTS, {"query_id": "none", "prompt": "Write f.", "entry": "f"}])
    with pytest.raises(DatasetError) as e:
        load_rows(path, fields, fmt)
    assert str(e.value) == (f"{path}:2: missing field 'input_output', and no assert-style tests to take it from "
                            "('test' with 'entry_point', 'asserts' or 'test_list') (row has: query_id, prompt, entry)")


@pytest.mark.parametrize("row, problem", [
    ({**MBPP, "test_list": ["assert f(1) == 2", "assert f(2) =="]}, r"test_list\[1\]: not valid Python"),
    ({**MBPP, "test_list": []}, "test_list: no tests"),
    ({**MBPP, "test_imports": ["import"]}, "test_setup_code and test_imports: not valid Python"),
    ({**HUMANEVAL, "entry_point": None}, "entry_point: expected the name of the function the test checks"),
    ({**HUMANEVAL, "test": "assert square(2) == 4"}, r"test: defines no function check\(candidate\)"),
    ({**IO, "input_output": {"asserts": "assert f(1)"}}, "input_output: 'asserts': expected a list"),
    ({**IO, "input_output": {"test": CHECK}}, "input_output: 'entry_point': expected the name"),
])
def test_bad_assert_style_tests_name_file_line_and_key(tmp_path, row, problem):
    path = _jsonl(tmp_path, [IO, row])
    with pytest.raises(DatasetError, match=f"^{path}:2: {problem}"):
        load_rows(path, CODE, "areal_code")


def test_parquet_rows_of_mixed_shapes_and_a_refusal_by_row(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    # One table, so every row has every column: null where a row has no such key.
    rows = [{**IO, "input_output": json.dumps(IO["input_output"])}, HUMANEVAL, MBPP, {"query_id": "x", "prompt": "p"}]
    keys = list(dict.fromkeys(k for r in rows for k in r))
    path = str(tmp_path / "mixed.parquet")
    pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in rows[:3]]), path)
    loaded = load_rows(path, CODE, "areal_code")
    assert [type(parse_tests(r["input_output"])).__name__ for r in loaded] == ["Tests", "AssertTests", "AssertTests"]
    pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in rows]), path)
    with pytest.raises(DatasetError) as e:
        load_rows(path, CODE, "areal_code")
    assert str(e.value).startswith(f"{path}: row 3: missing field 'input_output', and no assert-style")
    assert str(e.value).endswith("(row has: query_id, prompt)")


# ---- tests that cannot tell a right program from an empty one ----------------------------------

BLANK = "every expected output is blank: a program that prints nothing passes every test"
NONE = "every expected output is None: a function f() whose body is `pass` passes every test"
NO_ASSERT = ("no assert statement, raise or assert*() call in any test: nothing checks the program's answers, "
             "so a function whose body is `pass` passes")


@pytest.mark.parametrize("row, problem", [
    ({**IO, "input_output": {"inputs": ["1\n", "2\n"], "outputs": ["", " \n\t"]}}, f"input_output: {BLANK}"),
    ({**IO, "input_output": {"inputs": [["1"], "2\n"], "outputs": [[], "\n"]}}, f"input_output: {BLANK}"),
    ({**IO, "input_output": json.dumps({"inputs": [[1], [2]], "outputs": [None, "null"], "fn_name": "f"})},
     f"input_output: {NONE}"),
    ({**IO, "input_output": {"inputs": ["1", "2"], "outputs": [[None], "[null]"], "fn_name": "f"}},  # APPS's wrapping
     f"input_output: {NONE}"),
    ({**IO, "input_output": {"asserts": ["f(1) == 2", "f(2) == 4"]}}, f"input_output: {NO_ASSERT}"),
    ({**IO, "input_output": {"test": "def check(candidate):\n    candidate(2) == 4\n", "entry_point": "f"}},
     f"input_output: {NO_ASSERT}"),
    ({**MBPP, "test_list": ["f(1) == 2", "print(f(2))"]}, f"test_list: {NO_ASSERT}"),
    ({**ASSERTS, "asserts": ["f(0) == 0"]}, f"asserts: {NO_ASSERT}"),
    ({**HUMANEVAL, "test": "def check(candidate):\n    candidate(2)\n"}, f"test: {NO_ASSERT}"),
], ids=["stdin blank", "stdin blank lines", "fn None", "fn [None]", "asserts", "input_output test",
        "test_list", "row asserts", "humaneval test"])
def test_tests_an_empty_program_passes_are_refused_naming_file_and_line(tmp_path, row, problem):
    path = _jsonl(tmp_path, [IO, row])
    with pytest.raises(DatasetError) as e:
        load_rows(path, CODE, "areal_code")
    assert str(e.value) == f"{path}:2: {problem}"


@pytest.mark.parametrize("tests", [
    {"inputs": ["1\n", "2\n"], "outputs": ["", "2\n"]},                        # one output to print is enough
    {"inputs": [[1], [2]], "outputs": [None, 3], "fn_name": "f"},              # one value other than None
    {"inputs": [[1]], "outputs": [[None, None]], "fn_name": "f"},              # a list of Nones is a value
    {"inputs": [[1]], "outputs": [0], "fn_name": "f"},                         # 0, False, "" are not None
    {"inputs": [[1]], "outputs": ["None"], "fn_name": "f"},                    # the string, not the value
    {"asserts": ["f(1) == 2", "assert f(2) == 4"]},                            # one assert in any test
    {"asserts": ["if f(1) != 2:\n    raise ValueError(f(1))"]},
    {"asserts": ["import unittest\nunittest.TestCase().assertEqual(f(1), 2)"]},
    {"asserts": ["f(1) == 2"], "setup": "def g():\n    assert f(0) == 0\ng()"},  # the setup checks too
])
def test_tests_that_can_fail_an_empty_program_load(tmp_path, tests):
    rows = load_rows(_jsonl(tmp_path, [IO, {**IO, "query_id": "ok", "input_output": tests}]), CODE, "areal_code")
    assert json.loads(rows[1]["input_output"]) == tests


def test_degenerate_tests_in_a_parquet_file_are_refused_by_row(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [{**IO, "input_output": json.dumps(IO["input_output"])},
            {**IO, "query_id": "blank", "input_output": json.dumps({"inputs": ["1\n"], "outputs": ["\n"]})}]
    path = str(tmp_path / "blank.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(DatasetError) as e:
        load_rows(path, CODE, "areal_code")
    assert str(e.value) == f"{path}: row 1: input_output: {BLANK}"
