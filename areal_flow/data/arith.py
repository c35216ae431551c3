"""The tiny arithmetic task of the CPU default and of its peer benchmark (docs/benchmarks.md): "a+b="
answered with a scratchpad.

The completion writes one step per digit, least significant first, `"{da}+{db}+{carry}={sum};"`
(a missing digit is 0), then `"#### {a+b}"`. The tokenizer's EOS token is appended by callers,
so every function here deals in plain text. Operand lengths follow P(n) ∝ 1/n on 1..8: most
problems are short and a few are long, which gives the long-tail completion lengths (15-17 tokens
at n = 1, 78-87 at n = 8) that asynchronous training is meant to exploit.
"""

from __future__ import annotations

import json
import os
import random
import re

from areal_flow.runtime.disk import write_atomic

MAX_DIGITS = 8
# P(n) ∝ 1/n for the digit count of the larger operand.
_DIGIT_WEIGHTS = [1.0 / n for n in range(1, MAX_DIGITS + 1)]
_INT_RE = re.compile(r"-?\d+")
# Bump when the sampling or file format changes, so cached files of an older scheme are not reused.
DATA_VERSION = 1


def _random_number(rng: random.Random, digits: int) -> int:
    """A uniform `digits`-digit number: 0-9 for one digit, no leading zero otherwise."""
    if digits == 1:
        return rng.randint(0, 9)
    return rng.randint(10 ** (digits - 1), 10**digits - 1)


def sample_operands(rng: random.Random) -> tuple[int, int]:
    """Draw one problem: the larger operand has n ~ 1/n digits, the other 1..n, random order."""
    n = rng.choices(range(1, MAX_DIGITS + 1), weights=_DIGIT_WEIGHTS)[0]
    m = rng.randint(1, n)
    a, b = _random_number(rng, n), _random_number(rng, m)
    return (a, b) if rng.random() < 0.5 else (b, a)


def prompt_text(a: int, b: int) -> str:
    """The prompt for a+b, e.g. `"123+4567="`."""
    _check_operands(a, b)
    return f"{a}+{b}="


def completion_text(a: int, b: int) -> str:
    """The reference completion (without EOS), e.g. for 123+4567:
    `"3+7+0=10;2+6+1=9;1+5+0=6;0+4+0=4;#### 4690"`.

    There is one step per digit of the longer operand; a final carry shows up only in the answer.
    """
    _check_operands(a, b)
    da, db = str(a)[::-1], str(b)[::-1]
    steps, carry = [], 0
    for i in range(max(len(da), len(db))):
        x = int(da[i]) if i < len(da) else 0
        y = int(db[i]) if i < len(db) else 0
        s = x + y + carry
        steps.append(f"{x}+{y}+{carry}={s};")
        carry = s // 10
    return "".join(steps) + f"#### {a + b}"


def _check_operands(a: int, b: int) -> None:
    for name, v in (("a", a), ("b", b)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"operand {name} must be a non-negative int, got {v!r}")


def extract_answer(text: str) -> int | None:
    """The last integer after the last `"####"` in `text`; None when there is none."""
    _, sep, tail = text.rpartition("####")
    if not sep:
        return None
    found = _INT_RE.findall(tail)
    return int(found[-1]) if found else None


def arith_reward(completion: str, answer: str) -> float:
    """1.0 when the completion's extracted answer equals `answer`, else 0.0.

    A malformed `answer` is a data error, not a wrong completion, so it raises instead of
    silently scoring every sample 0.
    """
    try:
        expected = int(str(answer).strip())
    except ValueError:
        raise ValueError(f"arith_reward: reference answer {answer!r} is not an integer") from None
    return 1.0 if extract_answer(completion) == expected else 0.0


def check_prompt_text(a: int, b: int, claim: int) -> str:
    """A checker's prompt: is `claim` the sum? e.g. `"check 12+345=357\n"` (the two-agent example)."""
    _check_operands(a, b)
    return f"check {a}+{b}={claim}\n"


def check_completion_text(a: int, b: int, claim: int) -> str:
    """The checker's reference: the sum worked out as the solver works it, then the verdict, e.g.
    `"2+5+0=7;1+4+0=5;0+3+0=3;#### 357\nyes"`."""
    return completion_text(a, b) + ("\nyes" if claim == a + b else "\nno")


def check_reward(completion: str, right: bool) -> float:
    """1.0 when the checker's verdict (its last line, yes or no) says what is so, else 0.0."""
    verdict = completion.strip().rpartition("\n")[2].strip()
    return 1.0 if verdict == ("yes" if right else "no") else 0.0


def operands(prompt: str) -> tuple[int, int]:
    """(a, b) of a prompt `"a+b="` (ValueError for anything else)."""
    a, sep, b = prompt.strip().rstrip("=").partition("+")
    if not sep or not a.isdigit() or not b.isdigit():
        raise ValueError(f"not an arithmetic prompt a+b=: {prompt!r}")
    return int(a), int(b)


def heldout_problems(n_eval: int = 200, seed: int = 0) -> list[tuple[int, int]]:
    """`n_eval` distinct problems (by prompt) from a fixed seed: the held-out set.

    It depends only on (n_eval, seed), so the bootstrap and the data files agree on which
    prompts must never be trained on. Distinct, because with only 100 one-digit problems a
    sampled set would otherwise count some of them twice.
    """
    rng = random.Random(f"arith-eval-{seed}")  # str seeds are hashed with sha512: stable
    seen: set[str] = set()
    out: list[tuple[int, int]] = []
    while len(out) < n_eval:
        a, b = sample_operands(rng)
        p = prompt_text(a, b)
        if p not in seen:
            seen.add(p)
            out.append((a, b))
    return out


def _row(row_id: str, a: int, b: int) -> dict[str, str]:
    return {"id": row_id, "prompt": prompt_text(a, b), "answer": str(a + b)}


def write_jsonl_atomic(path: str, rows: list[dict]) -> None:
    """`rows` as JSON lines, written whole: readers see all rows or no file."""
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))


def ensure_arith_data(
    data_dir: str, n_train: int = 20000, n_eval: int = 200, seed: int = 0
) -> tuple[str, str]:
    """Write (or reuse) `train.jsonl` and `eval.jsonl` for these settings; return their paths.

    Files go to `data_dir/arith-v{DATA_VERSION}-train{n_train}-eval{n_eval}-seed{seed}/`, so
    files of other settings are never mistaken for these. Train rows are sampled from the task
    mix with every held-out prompt excluded; they may repeat each other (short problems are few).
    """
    if n_train < 1 or n_eval < 1:
        raise ValueError(f"n_train and n_eval must be >= 1, got n_train={n_train}, n_eval={n_eval}")
    folder = os.path.join(
        data_dir, f"arith-v{DATA_VERSION}-train{n_train}-eval{n_eval}-seed{seed}"
    )
    train_path = os.path.join(folder, "train.jsonl")
    eval_path = os.path.join(folder, "eval.jsonl")
    # Each file is published by an atomic rename, so existing means complete.
    if os.path.isfile(train_path) and os.path.isfile(eval_path):
        return train_path, eval_path
    os.makedirs(folder, exist_ok=True)

    heldout = heldout_problems(n_eval, seed)
    excluded = {prompt_text(a, b) for a, b in heldout}
    rng = random.Random(f"arith-train-{seed}")
    train: list[dict[str, str]] = []
    while len(train) < n_train:
        a, b = sample_operands(rng)
        if prompt_text(a, b) not in excluded:
            train.append(_row(f"train-{len(train)}", a, b))
    write_jsonl_atomic(eval_path, [_row(f"eval-{i}", a, b) for i, (a, b) in enumerate(heldout)])
    write_jsonl_atomic(train_path, train)
    return train_path, eval_path
