"""JSONL prompt datasets: one JSON object per line, with errors that point at the line.

Every row comes back as `dict[str, str]` with an `id`: its own `"id"` field when present, else
`"{file stem}:{line}"`, so samples can carry a stable prompt id for provenance.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence


class DatasetError(ValueError):
    """A dataset file that cannot be used; the message names the file and, where known, the line."""


def _to_str(value: object) -> str:
    # Numbers become their plain text ("4690"); nested values keep JSON syntax rather than
    # Python's repr, so they can be parsed back.
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, list, bool)):
        return json.dumps(value)
    return str(value)


def load_jsonl(path: str, required: Sequence[str]) -> list[dict[str, str]]:
    """Load a JSONL file whose rows must each have the fields `required`.

    Blank lines are skipped (a trailing newline is common). Raises `DatasetError` for a missing
    file, an empty file, a line that is not a JSON object, a row missing a required field (or
    with it null), and two rows with the same id.
    """
    if not os.path.exists(path):
        raise DatasetError(f"{path}: dataset file does not exist")
    if not os.path.isfile(path):
        raise DatasetError(f"{path}: dataset path is not a file")
    stem = os.path.splitext(os.path.basename(path))[0]
    rows: list[dict[str, str]] = []
    id_line: dict[str, int] = {}
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
            if not isinstance(obj, dict):
                raise DatasetError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            for field in required:
                if field not in obj:
                    has = ", ".join(obj) or "no fields"
                    raise DatasetError(f"{where}: missing field {field!r} (row has: {has})")
                if obj[field] is None:
                    raise DatasetError(f"{where}: field {field!r} is null")
            row = {k: _to_str(v) for k, v in obj.items() if v is not None}
            row_id = row.get("id", f"{stem}:{lineno}")
            row["id"] = row_id
            if row_id in id_line:
                raise DatasetError(
                    f"{where}: duplicate id {row_id!r} (first used on line {id_line[row_id]})"
                )
            id_line[row_id] = lineno
            rows.append(row)
    if not rows:
        raise DatasetError(f"{path}: dataset file is empty (no JSON rows)")
    return rows
