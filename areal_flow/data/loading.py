"""From `dataset.*` to prompt rows: which files a config names, and the rows the run uses.

The launcher calls both before any process starts, so a bad path, row or template is reported
with its file and line (or row); the controller calls `load_prompts` again for the rows it hands
out, with the model's tokenizer, so the chat template is applied once, in one place.
"""

from __future__ import annotations

import os
from pathlib import Path

from areal_flow.config.validate import model_context
from areal_flow.data.dataset import DatasetError, load_rows
from areal_flow.data.templates import apply_templates

SAMPLES_DIR = Path(__file__).resolve().parent / "samples"
# dataset.name -> sample files (train, held-out) in SAMPLES_DIR
SAMPLES = {
    "areal_math": ("math_sample.jsonl", "math_sample_eval.jsonl"),
    "areal_code": ("code_sample.jsonl", "code_sample_eval.jsonl"),
}


# dataset.name -> its rows' format (`dataset.load_rows`) where the name is not a format itself:
# tiny_arith writes generic JSONL; tiny_code and humaneval (train and held out) AReaL's code rows.
ROW_FORMATS = {"tiny_arith": "jsonl", "tiny_code": "areal_code", "humaneval": "areal_code"}
GENERATED = ("tiny_arith", "tiny_code")  # the names whose data is generated into the cache


def row_format(name: str) -> str:
    """The row format (`dataset.load_rows`) of a `dataset.name`."""
    return ROW_FORMATS.get(name, name)


def _generate(ds, data_dir: str) -> tuple[str, str]:
    """The train and held-out files of a generated task, written into `data_dir` once."""
    if ds.name == "tiny_code":
        from areal_flow.data.tiny_code import ensure_tiny_code_data as ensure
    else:
        from areal_flow.data.arith import ensure_arith_data as ensure
    return ensure(data_dir, ds.n_train, ds.n_eval, ds.seed)


def dataset_paths(ds, cache_dir: str) -> tuple[str, str]:
    """Absolute paths of the train and held-out data a `DatasetConfig` names; tiny_arith's and
    tiny_code's are generated into `cache_dir`/data first."""
    if ds.name in GENERATED:
        if ds.train_path:
            raise DatasetError(f"dataset.name={ds.name} generates its training problems: leave dataset.train_path "
                               "null (dataset.eval_path may name an external held-out file)")
        train, held_out = _generate(ds, os.path.join(cache_dir, "data"))
        # An external held-out file (e.g. the problems a peer is scored on) replaces the generated one.
        held_out = ds.eval_path or held_out
    elif ds.name == "humaneval":
        train, held_out = humaneval_paths(ds, cache_dir)
    elif ds.sample:
        if ds.name not in SAMPLES:
            raise DatasetError(f"dataset.sample=true needs dataset.name in {', '.join(SAMPLES)}, not {ds.name!r}")
        if ds.train_path or ds.eval_path:
            raise DatasetError("dataset.sample=true uses the shipped sample set: leave dataset.train_path and "
                               "dataset.eval_path null")
        train, held_out = (str(SAMPLES_DIR / f) for f in SAMPLES[ds.name])
    elif ds.name in ("jsonl", *SAMPLES):
        if not ds.train_path or not ds.eval_path:
            hint = " (or dataset.sample=true)" if ds.name in SAMPLES else ""
            raise DatasetError(f"dataset.name={ds.name} needs dataset.train_path and dataset.eval_path{hint}")
        train, held_out = ds.train_path, ds.eval_path
    else:
        raise DatasetError(f"unknown dataset.name {ds.name!r}; expected tiny_arith, tiny_code, jsonl, areal_math, "
                           "areal_code or humaneval")
    return os.path.abspath(train), os.path.abspath(held_out)


def humaneval_paths(ds, cache_dir: str) -> tuple[str, str]:
    """dataset.name=humaneval: code rows to train on (dataset.train_path, or the code samples with
    dataset.sample=true), and HumanEval's problems held out, written into `cache_dir`/data once."""
    from areal_flow.data.humaneval import ensure_humaneval

    if ds.eval_path:
        raise DatasetError("dataset.name=humaneval holds out HumanEval's 164 problems: leave dataset.eval_path null")
    if bool(ds.train_path) == ds.sample:
        raise DatasetError("dataset.name=humaneval trains on dataset.train_path (areal_code rows) or, with "
                           "dataset.sample=true, on the shipped code samples: set exactly one of them")
    train = ds.train_path or str(SAMPLES_DIR / SAMPLES["areal_code"][0])
    return train, ensure_humaneval(os.path.join(cache_dir, "data"))


def prompt_room(cfg, model_path: str) -> int | None:
    """The prompt tokens the model's context leaves beside the answer's budget (None: no limit known,
    as for a directory with a tokenizer only, which tests give a controller)."""
    if not os.path.isfile(os.path.join(model_path, "config.json")):
        return None
    positions = model_context(model_path)
    return None if positions is None else positions - cfg.algorithm.max_new_tokens


def load_prompts(ds, path: str, split: str, prompt_key: str, tokenizer=None, room: int | None = None,
                 skipped: list[str] | None = None) -> list[dict[str, str]]:
    """The rows of `path` checked against `ds.name`'s format and `ds.fields`, with the prompt
    templates applied to `prompt_key`. Without a tokenizer the chat template is left out (the
    launcher checks rows before the model exists, and the chat template separately). A prompt that
    is empty or only whitespace after the format string is refused, naming its file and line (or
    row): drawn, it would fail at a generation server, naming neither. So is, with a tokenizer and
    `room` (the model's context less the answer's budget), a prompt of more tokens than `room`; with
    dataset.long_prompts=skip it is left out instead and its place appended to `skipped`."""
    places = []
    rows = load_rows(path, list(ds.fields), row_format(ds.name), split, places)
    rows = apply_templates(rows, prompt_key, path, ds.prompt_template)
    for row, where in zip(rows, places):
        if prompt_key in row and not row[prompt_key].strip():
            after = f" after dataset.prompt_template {ds.prompt_template!r}" if ds.prompt_template is not None else ""
            raise DatasetError(f"{where}: the prompt (field {prompt_key!r}) is empty{after}: {row[prompt_key]!r}")
    rows = apply_templates(rows, prompt_key, path, None, ds.chat_template, tokenizer)
    if tokenizer is None or room is None or not rows:
        return rows
    return fit_context(ds, rows, places, prompt_key, tokenizer, room, skipped if skipped is not None else [])


def fit_context(ds, rows: list[dict[str, str]], places: list[str], prompt_key: str, tokenizer, room: int,
                skipped: list[str]) -> list[dict[str, str]]:
    """The rows whose prompt, tokenized as a rollout worker does, has at most `room` tokens; a
    longer one is refused (DatasetError naming its place) or, with dataset.long_prompts=skip, left
    out and its place appended to `skipped`."""
    lengths = [len(ids) for ids in tokenizer([row[prompt_key] for row in rows], add_special_tokens=False)["input_ids"]]
    kept = []
    for row, where, n in zip(rows, places, lengths):
        if n <= room:
            kept.append(row)
        elif ds.long_prompts == "skip":
            skipped.append(where)
        else:
            raise DatasetError(f"{where}: the prompt (field {prompt_key!r}) is {n} tokens, over the {room} the model's "
                               "context leaves beside algorithm.max_new_tokens: shorten it, or set "
                               "dataset.long_prompts=skip")
    return kept
