"""AReaL's math and code row formats, on JSONL: good rows, every bad row named by file, line and
field, and the reader chosen by the path."""

import json

import pytest

from areal_flow.data.dataset import DatasetError, load_jsonl, load_rows

MATH = ["prompt", "solutions"]
CODE = ["prompt", "input_output"]


def _jsonl(tmp_path, rows, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _math(qid="q1", **kw):
    return {"query_id": qid, "prompt": "What is 1+1?", "solutions": ["\\boxed{2}"], **kw}


def _code(qid="c1", io=None, **kw):
    io = {"inputs": ["1 2\n"], "outputs": ["3\n"]} if io is None else io
    return {"query_id": qid, "prompt": "Add two numbers.", "input_output": io, **kw}


def test_math_rows_take_query_id_as_id_and_keep_solutions_as_json(tmp_path):
    path = _jsonl(tmp_path, [_math("a"), _math(7, solutions=["\\frac{1}{2}", "0.5"], extra=3)])
    rows = load_rows(path, MATH, "areal_math")
    assert rows == [
        {"id": "a", "query_id": "a", "prompt": "What is 1+1?", "solutions": '["\\\\boxed{2}"]'},
        {"id": "7", "query_id": "7", "prompt": "What is 1+1?", "solutions": '["\\\\frac{1}{2}", "0.5"]', "extra": "3"},
    ]
    assert json.loads(rows[1]["solutions"]) == ["\\frac{1}{2}", "0.5"]


def test_code_rows_accept_input_output_as_json_text_or_object(tmp_path):
    as_text = json.dumps({"inputs": [[1, 2], [3, 4]], "outputs": [3, 7], "fn_name": "add"})
    path = _jsonl(tmp_path, [_code("s"), _code("f", io=as_text), _code("n", io={"inputs": ["x"], "outputs": ["y"],
                                                                              "fn_name": None})])
    rows = load_rows(path, CODE, "areal_code")
    assert [r["id"] for r in rows] == ["s", "f", "n"]
    assert rows[1]["input_output"] == as_text  # text stays as written
    assert json.loads(rows[0]["input_output"]) == {"inputs": ["1 2\n"], "outputs": ["3\n"]}


@pytest.mark.parametrize("solutions, problem", [
    ("\\boxed{2}", "solutions: expected a list of answer strings, got str"),
    ([], "solutions: the list is empty"),
    (["\\boxed{2}", 2], "solutions: item 1 is int, expected a string"),
    (["  "], "solutions: item 0 is an empty string"),
])
def test_bad_solutions_name_file_line_and_field(tmp_path, solutions, problem):
    path = _jsonl(tmp_path, [_math("a"), _math("b", solutions=solutions)], name="math.jsonl")
    with pytest.raises(DatasetError) as e:
        load_rows(path, MATH, "areal_math")
    assert str(e.value) == f"{path}:2: {problem}"


@pytest.mark.parametrize("io, problem", [
    ('{"inputs": [1], ', "input_output: not valid JSON"),
    ("[1, 2]", "input_output: expected an object, {inputs, outputs, fn_name?}, {test, entry_point} or {asserts, setup?}; got list"),
    ({"inputs": ["1"]}, "input_output: missing 'outputs' (it has: inputs)"),
    ({"inputs": "1", "outputs": ["1"]}, "input_output: 'inputs' is str, expected a list of test cases"),
    ({"inputs": [], "outputs": []}, "input_output: no test cases ('inputs' is empty)"),
    ({"inputs": ["1", "2", "3"], "outputs": ["1", "2"]}, "input_output: 'inputs' has 3 cases, 'outputs' has 2"),
    (json.dumps({"inputs": [[1]], "outputs": [1], "fn_name": 5}), "input_output: 'fn_name' must be a function name (a Python identifier), got 5"),
    (json.dumps({"inputs": ["[1"], "outputs": [1], "fn_name": "f"}), "input_output: inputs[0] is not one JSON value per line"),
])
def test_bad_input_output_names_file_line_and_field(tmp_path, io, problem):
    rows = [_code(f"c{i}") for i in range(6)] + [_code("bad", io=io)]
    path = _jsonl(tmp_path, rows, name="code.jsonl")
    with pytest.raises(DatasetError) as e:
        load_rows(path, CODE, "areal_code")
    assert str(e.value).startswith(f"{path}:7: {problem}")


@pytest.mark.parametrize("fmt, row, problem", [
    ("areal_math", {"prompt": "p", "solutions": ["1"]}, "missing field 'query_id' (row has: prompt, solutions)"),
    ("areal_math", {"query_id": "q", "solutions": ["1"]}, "missing field 'prompt'"),
    ("areal_math", {"query_id": "q", "prompt": "p", "solutions": None}, "field 'solutions' is null"),
    ("areal_math", {"query_id": "q", "prompt": ["p"], "solutions": ["1"]}, "prompt: expected a string, got list"),
    ("areal_code", {"query_id": "q", "prompt": "p"}, "missing field 'input_output'"),
])
def test_the_format_fields_are_required_whatever_dataset_fields_says(tmp_path, fmt, row, problem):
    path = _jsonl(tmp_path, [row])
    with pytest.raises(DatasetError) as e:
        load_rows(path, ["prompt"], fmt)
    assert str(e.value).startswith(f"{path}:1: {problem}")


def test_fields_beyond_the_format_are_required_too(tmp_path):
    path = _jsonl(tmp_path, [_math()])
    with pytest.raises(DatasetError, match=r":1: missing field 'level'"):
        load_rows(path, [*MATH, "level"], "areal_math")


def test_duplicate_query_ids_name_both_lines(tmp_path):
    path = _jsonl(tmp_path, [_math("a"), _math("b"), _math("a")])
    with pytest.raises(DatasetError, match=f"^{path}:3: duplicate id 'a' \\(first used on line 1\\)"):
        load_rows(path, MATH, "areal_math")


@pytest.mark.parametrize("fmt, fields", [("jsonl", ["prompt"]), ("areal_math", MATH), ("areal_code", CODE)])
def test_an_empty_jsonl_dataset_is_an_error_for_every_format(tmp_path, fmt, fields):
    path = _jsonl(tmp_path, ["", "  "])
    with pytest.raises(DatasetError, match=f"^{path}: dataset is empty"):
        load_rows(path, fields, fmt)


def test_the_reader_is_chosen_by_the_path(tmp_path):
    other = tmp_path / "rows.csv"
    other.write_text("prompt\n1+1=\n")
    with pytest.raises(DatasetError, match=r"rows.csv: unknown dataset type; expected a .jsonl file"):
        load_rows(str(other), ["prompt"])
    plain_dir = tmp_path / "folder"
    plain_dir.mkdir()
    with pytest.raises(DatasetError, match=r"folder: a directory, but not one written by datasets' save_to_disk"):
        load_rows(str(plain_dir), ["prompt"])
    with pytest.raises(DatasetError, match=r"nope.jsonl: dataset file does not exist"):
        load_rows(str(tmp_path / "nope.jsonl"), ["prompt"])


def test_load_jsonl_reads_jsonl_whatever_the_suffix(tmp_path):
    path = _jsonl(tmp_path, [{"prompt": "1+1="}], name="rows.txt")
    assert load_jsonl(path, ["prompt"]) == [{"prompt": "1+1=", "id": "rows:1"}]


def test_an_unknown_format_is_refused(tmp_path):
    with pytest.raises(DatasetError, match="unknown dataset format 'csv'"):
        load_rows(_jsonl(tmp_path, [{"prompt": "p"}]), ["prompt"], "csv")
