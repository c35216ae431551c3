"""Parquet files and directories saved by `datasets`: round trips, errors by row, DatasetDict
splits, and the message when the optional packages are missing."""

import json
import sys

import pytest

from areal_flow.data.dataset import DatasetError, load_rows

MATH_ROWS = [
    {"query_id": "m0", "prompt": "What is 1+1?", "solutions": ["\\boxed{2}"]},
    {"query_id": "m1", "prompt": "What is 1/2?", "solutions": ["\\frac{1}{2}", "0.5"]},
]
CODE_ROWS = [
    {"query_id": "c0", "prompt": "Sum.", "input_output": json.dumps({"inputs": ["1 2\n"], "outputs": ["3\n"]})},
    {"query_id": "c1", "prompt": "Rev.", "input_output": json.dumps({"inputs": [["ab"]], "outputs": ["ba"], "fn_name": "rev"})},
]
MATH_LOADED = [
    {"id": "m0", "query_id": "m0", "prompt": "What is 1+1?", "solutions": '["\\\\boxed{2}"]'},
    {"id": "m1", "query_id": "m1", "prompt": "What is 1/2?", "solutions": '["\\\\frac{1}{2}", "0.5"]'},
]


def _parquet(tmp_path, rows, name="data.parquet", schema=None):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / name
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), str(path))
    return str(path)


def _saved(tmp_path, rows, name="saved", splits=None):
    datasets = pytest.importorskip("datasets")
    path = tmp_path / name
    if splits is None:
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    else:
        datasets.DatasetDict({s: datasets.Dataset.from_list(r) for s, r in splits.items()}).save_to_disk(str(path))
    return str(path)


def test_parquet_round_trip_math(tmp_path):
    assert load_rows(_parquet(tmp_path, MATH_ROWS), ["prompt", "solutions"], "areal_math") == MATH_LOADED


def test_parquet_code_rows_with_input_output_as_a_struct(tmp_path):
    # A struct column gives the row without fn_name a null there: the same as absent.
    rows = [{"query_id": "a", "prompt": "p", "input_output": {"inputs": ["1\n"], "outputs": ["1\n"], "fn_name": None}},
            {"query_id": "b", "prompt": "p", "input_output": {"inputs": ["[1, 2]"], "outputs": ["3"], "fn_name": "f"}}]
    loaded = load_rows(_parquet(tmp_path, rows), ["prompt", "input_output"], "areal_code")
    assert json.loads(loaded[1]["input_output"]) == {"inputs": ["[1, 2]"], "outputs": ["3"], "fn_name": "f"}


def test_parquet_generic_rows_get_row_numbered_ids(tmp_path):
    path = _parquet(tmp_path, [{"prompt": "1+1=", "answer": 2}, {"prompt": "2+2=", "answer": 4}], name="arith.parquet")
    assert load_rows(path, ["prompt", "answer"]) == [
        {"prompt": "1+1=", "answer": "2", "id": "arith:0"}, {"prompt": "2+2=", "answer": "4", "id": "arith:1"}]


def test_parquet_bad_row_names_file_row_and_field(tmp_path):
    rows = [*MATH_ROWS, {"query_id": "m2", "prompt": "p", "solutions": []}]
    path = _parquet(tmp_path, rows)
    with pytest.raises(DatasetError) as e:
        load_rows(path, ["prompt", "solutions"], "areal_math")
    assert str(e.value) == f"{path}: row 2: solutions: the list is empty"


def test_parquet_bad_code_row_names_file_row_and_field(tmp_path):
    bad = {"query_id": "c2", "prompt": "p", "input_output": json.dumps({"inputs": ["1", "2"], "outputs": ["1"]})}
    path = _parquet(tmp_path, [*CODE_ROWS, bad])
    with pytest.raises(DatasetError) as e:
        load_rows(path, ["prompt", "input_output"], "areal_code")
    assert str(e.value) == f"{path}: row 2: input_output: 'inputs' has 2 cases, 'outputs' has 1"


def test_parquet_null_and_duplicate_name_the_row(tmp_path):
    path = _parquet(tmp_path, [{"query_id": "a", "prompt": "p", "solutions": ["1"]},
                               {"query_id": "b", "prompt": None, "solutions": ["1"]}])
    with pytest.raises(DatasetError, match=r": row 1: field 'prompt' is null"):
        load_rows(path, ["prompt", "solutions"], "areal_math")
    path = _parquet(tmp_path, [MATH_ROWS[0], MATH_ROWS[1], MATH_ROWS[0]], name="dup.parquet")
    with pytest.raises(DatasetError, match=r"dup.parquet: row 2: duplicate id 'm0' \(first used on row 0\)"):
        load_rows(path, ["prompt", "solutions"], "areal_math")


@pytest.mark.parametrize("fmt, fields", [("jsonl", ["prompt"]), ("areal_math", ["prompt", "solutions"]),
                                         ("areal_code", ["prompt", "input_output"])])
def test_an_empty_parquet_file_is_an_error_for_every_format(tmp_path, fmt, fields):
    pa = pytest.importorskip("pyarrow")
    schema = pa.schema([("query_id", pa.string()), ("prompt", pa.string()), ("solutions", pa.list_(pa.string())),
                        ("input_output", pa.string())])
    path = _parquet(tmp_path, [], schema=schema)
    with pytest.raises(DatasetError, match=f"^{path}: dataset is empty"):
        load_rows(path, fields, fmt)


def test_a_corrupt_parquet_file_is_named(tmp_path):
    pytest.importorskip("pyarrow")
    path = tmp_path / "bad.parquet"
    path.write_bytes(b"not parquet at all")
    with pytest.raises(DatasetError, match=f"^{path}: not a readable Parquet file"):
        load_rows(str(path), ["prompt"])


def test_saved_dataset_round_trip(tmp_path):
    assert load_rows(_saved(tmp_path, MATH_ROWS), ["prompt", "solutions"], "areal_math") == MATH_LOADED
    code = load_rows(_saved(tmp_path, CODE_ROWS, name="code"), ["prompt", "input_output"], "areal_code")
    assert [r["input_output"] for r in code] == [r["input_output"] for r in CODE_ROWS]


def test_saved_dataset_dict_reads_the_chosen_split(tmp_path):
    path = _saved(tmp_path, None, splits={"train": MATH_ROWS, "test": MATH_ROWS[:1]})
    assert load_rows(path, ["prompt", "solutions"], "areal_math", split="train") == MATH_LOADED
    assert load_rows(path, ["prompt", "solutions"], "areal_math", split="test") == MATH_LOADED[:1]
    with pytest.raises(DatasetError, match=f"^{path}: a DatasetDict with no split 'validation' \\(it has: train, test\\)"):
        load_rows(path, ["prompt", "solutions"], "areal_math", split="validation")


def test_saved_dataset_bad_row_names_dir_row_and_field(tmp_path):
    bad = {"query_id": "c2", "prompt": "p", "input_output": "{not json"}
    path = _saved(tmp_path, [*CODE_ROWS, bad])
    with pytest.raises(DatasetError, match=f"^{path}: row 2: input_output: not valid JSON"):
        load_rows(path, ["prompt", "input_output"], "areal_code")


def test_an_empty_saved_dataset_is_an_error(tmp_path):
    datasets = pytest.importorskip("datasets")
    path = str(tmp_path / "empty")
    datasets.Dataset.from_list(MATH_ROWS).select([]).save_to_disk(path)
    with pytest.raises(DatasetError, match=f"^{path}: dataset is empty"):
        load_rows(path, ["prompt", "solutions"], "areal_math")


@pytest.mark.parametrize("module, target", [("pyarrow", "data.parquet"), ("datasets", "saved")])
def test_a_missing_optional_package_says_how_to_install_it(tmp_path, monkeypatch, module, target):
    path = tmp_path / target
    if target.endswith(".parquet"):
        path.write_bytes(b"")
    else:
        path.mkdir()
        (path / "state.json").write_text("{}")
    for name in [m for m in sys.modules if m == module or m.startswith(module + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError
    with pytest.raises(DatasetError) as e:
        load_rows(str(path), ["prompt"])
    assert str(e.value).startswith(f"{path}: reading ") and f"'{module}'" in str(e.value)
    assert "pip install -e '.[data]'" in str(e.value)


def test_an_empty_split_of_a_saved_dataset_dict_is_an_error(tmp_path):
    datasets = pytest.importorskip("datasets")
    path = str(tmp_path / "dd")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(MATH_ROWS),
                          "test": datasets.Dataset.from_list(MATH_ROWS).select([])}).save_to_disk(path)
    assert len(load_rows(path, ["prompt"], "areal_math", split="train")) == 2
    with pytest.raises(DatasetError, match=f"^{path}: dataset is empty"):
        load_rows(path, ["prompt"], "areal_math", split="test")


def test_a_bad_row_of_a_dataset_dict_names_the_split_folder(tmp_path):
    bad = {"query_id": "m9", "prompt": "p", "solutions": [""]}
    path = _saved(tmp_path, None, splits={"train": MATH_ROWS, "test": [MATH_ROWS[0], bad]})
    with pytest.raises(DatasetError) as e:
        load_rows(path, ["prompt", "solutions"], "areal_math", split="test")
    assert str(e.value) == f"{path}/test: row 1: solutions: item 0 is an empty string"
