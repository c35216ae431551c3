import pytest

from areal_flow.data.dataset import DatasetError, load_jsonl


def _write(tmp_path, text, name="prompts.jsonl"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_rows_get_ids_and_string_values(tmp_path):
    path = _write(
        tmp_path,
        '{"id": "a", "prompt": "1+2=", "answer": 3}\n'
        "\n"
        '{"prompt": "4+5=", "answer": "9", "meta": {"k": [1]}}\n',
    )
    rows = load_jsonl(path, ["prompt", "answer"])
    assert rows == [
        {"id": "a", "prompt": "1+2=", "answer": "3"},
        {"id": "prompts:3", "prompt": "4+5=", "answer": "9", "meta": '{"k": [1]}'},
    ]


def test_missing_file_names_the_path(tmp_path):
    path = str(tmp_path / "nope.jsonl")
    with pytest.raises(DatasetError, match=f"{path}: .*does not exist"):
        load_jsonl(path, ["prompt"])


def test_empty_file_is_an_error(tmp_path):
    path = _write(tmp_path, "\n  \n")
    with pytest.raises(DatasetError, match="empty"):
        load_jsonl(path, ["prompt"])


def test_bad_json_names_the_line(tmp_path):
    path = _write(tmp_path, '{"prompt": "1+1="}\n{"prompt": \n')
    with pytest.raises(DatasetError, match=f"^{path}:2: not valid JSON"):
        load_jsonl(path, ["prompt"])


def test_non_object_row_names_the_line(tmp_path):
    path = _write(tmp_path, '{"prompt": "1+1="}\n["1+1="]\n')
    with pytest.raises(DatasetError, match=f"^{path}:2: expected a JSON object, got list"):
        load_jsonl(path, ["prompt"])


def test_missing_field_names_line_field_and_present_fields(tmp_path):
    path = _write(tmp_path, '{"id": "x", "prompt": "1+1=", "answer": "2"}\n'
                            '{"id": "y", "prompt": "2+2="}\n')
    with pytest.raises(DatasetError) as e:
        load_jsonl(path, ["prompt", "answer"])
    assert str(e.value) == f"{path}:2: missing field 'answer' (row has: id, prompt)"


def test_null_required_field_is_an_error(tmp_path):
    path = _write(tmp_path, '{"prompt": "1+1=", "answer": null}\n')
    with pytest.raises(DatasetError, match=":1: field 'answer' is null"):
        load_jsonl(path, ["prompt", "answer"])


def test_duplicate_ids_name_both_lines(tmp_path):
    path = _write(tmp_path, '{"id": 7, "prompt": "a"}\n{"id": 8, "prompt": "b"}\n'
                            '{"id": "7", "prompt": "c"}\n')
    with pytest.raises(DatasetError, match=f"^{path}:3: duplicate id '7' \\(first used on line 1\\)"):
        load_jsonl(path, ["prompt"])


def test_invalid_utf8_names_the_line(tmp_path):
    path = tmp_path / "bin.jsonl"
    path.write_bytes(b'{"prompt": "ok"}\n{"prompt": "\xff"}\n')
    with pytest.raises(DatasetError, match=":2: not valid UTF-8"):
        load_jsonl(str(path), ["prompt"])
