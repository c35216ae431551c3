import json
import os
import random
import re
from collections import Counter

import pytest

from areal_flow.data import arith
from areal_flow.data.arith import (
    arith_reward,
    completion_text,
    ensure_arith_data,
    extract_answer,
    heldout_problems,
    prompt_text,
    sample_operands,
)
from areal_flow.models.tokenizer import build_char_tokenizer


def test_worked_example_from_the_spec():
    assert prompt_text(123, 4567) == "123+4567="
    assert completion_text(123, 4567) == "3+7+0=10;2+6+1=9;1+5+0=6;0+4+0=4;#### 4690"


def test_final_carry_appears_only_in_the_answer():
    assert completion_text(9, 9) == "9+9+0=18;#### 18"
    assert completion_text(0, 0) == "0+0+0=0;#### 0"


def test_scratchpad_steps_are_correct_digit_additions():
    rng = random.Random(1)
    step = re.compile(r"(\d)\+(\d)\+([01])=(\d+);")
    for _ in range(500):
        a, b = sample_operands(rng)
        text = completion_text(a, b)
        steps = step.findall(text)
        assert len(steps) == max(len(str(a)), len(str(b)))
        carry = 0
        for i, (x, y, c, s) in enumerate(steps):
            assert int(x) == (a // 10**i) % 10 and int(y) == (b // 10**i) % 10
            assert int(c) == carry and int(s) == int(x) + int(y) + carry
            carry = int(s) // 10
        assert extract_answer(text) == a + b


def test_negative_operands_are_rejected():
    with pytest.raises(ValueError, match="operand a"):
        completion_text(-1, 3)


def test_completion_lengths_with_eos_match_the_spec_ranges():
    tok = build_char_tokenizer()
    rng = random.Random(0)
    problems = [sample_operands(rng) for _ in range(5000)]
    ids = tok([completion_text(a, b) for a, b in problems], add_special_tokens=False)["input_ids"]
    by_n: dict[int, list[int]] = {}
    for (a, b), x in zip(problems, ids):
        by_n.setdefault(max(len(str(a)), len(str(b))), []).append(len(x) + 1)  # + EOS
    for n, (lo, hi) in {1: (15, 17), 4: (42, 47), 8: (78, 87)}.items():
        assert lo <= min(by_n[n]) and max(by_n[n]) <= hi, (n, min(by_n[n]), max(by_n[n]))
    lengths = sorted(len(x) + 1 for x in ids)
    mean = sum(lengths) / len(lengths)
    assert 31 < mean < 36.5  # spec: mean 33.7 over the mix
    assert 66 <= lengths[int(0.9 * len(lengths))] <= 72  # spec: p90 69


def test_digit_counts_follow_one_over_n():
    rng = random.Random(0)
    samples = [sample_operands(rng) for _ in range(20000)]
    counts = Counter(max(len(str(a)), len(str(b))) for a, b in samples)
    harmonic = sum(1 / n for n in range(1, 9))
    for n in range(1, 9):
        expected = (1 / n) / harmonic
        assert abs(counts[n] / len(samples) - expected) < 0.012, (n, counts[n])
    # The shorter operand has a uniform count in 1..n, and either operand may come first.
    eight = [(a, b) for a, b in samples if max(len(str(a)), len(str(b))) == 8]
    shorter = Counter(min(len(str(a)), len(str(b))) for a, b in eight)
    assert all(shorter[m] > len(eight) / 8 * 0.6 for m in range(1, 9))
    unequal = [(a, b) for a, b in samples if len(str(a)) != len(str(b))]
    first_longer = sum(len(str(a)) > len(str(b)) for a, b in unequal) / len(unequal)
    assert 0.47 < first_longer < 0.53
    # One-digit numbers include 0.
    assert any(0 in p for p in samples)


def test_extract_answer_edge_cases():
    assert extract_answer("3+4+0=7;#### 7") == 7
    assert extract_answer("no marker 42") is None
    assert extract_answer("") is None
    assert extract_answer("####") is None
    assert extract_answer("#### ") is None
    assert extract_answer("#### 4690;;junk") == 4690
    assert extract_answer("#### 12 then 34") == 34  # the last integer after the marker
    assert extract_answer("#### 1 #### 2") == 2  # after the last marker
    assert extract_answer("#### 5 ####") is None
    assert extract_answer("#### -5") == -5


def test_reward_is_exact_match_of_the_extracted_integer():
    assert arith_reward("9+9+0=18;#### 18", "18") == 1.0
    assert arith_reward("#### 018", "18") == 1.0
    assert arith_reward("#### 17", "18") == 0.0
    assert arith_reward("18", "18") == 0.0
    assert arith_reward("#### -18", "18") == 0.0
    assert arith_reward("", "0") == 0.0
    with pytest.raises(ValueError, match="not an integer"):
        arith_reward("#### 1", "one")


def _read(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_data_files_are_disjoint_fixed_and_reused(tmp_path):
    train_path, eval_path = ensure_arith_data(str(tmp_path), n_train=3000, n_eval=200, seed=0)
    train, held = _read(train_path), _read(eval_path)
    assert len(train) == 3000 and len(held) == 200
    assert set(train[0]) == {"id", "prompt", "answer"}
    eval_prompts = {r["prompt"] for r in held}
    assert len(eval_prompts) == 200  # distinct problems
    assert eval_prompts.isdisjoint(r["prompt"] for r in train)
    assert len({r["id"] for r in train + held}) == 3200
    for r in held + train[:50]:
        a, b = map(int, r["prompt"][:-1].split("+"))
        assert int(r["answer"]) == a + b
    assert [prompt_text(a, b) for a, b in heldout_problems(200, 0)] == [r["prompt"] for r in held]

    # Same settings: same files, not rewritten. Other train size: same held-out set.
    mtime = os.stat(train_path).st_mtime_ns
    assert ensure_arith_data(str(tmp_path), n_train=3000) == (train_path, eval_path)
    assert os.stat(train_path).st_mtime_ns == mtime
    other_train, other_eval = ensure_arith_data(str(tmp_path), n_train=1000)
    assert other_train != train_path
    assert _read(other_eval) == held


def test_interrupted_write_leaves_no_file(tmp_path, monkeypatch):
    real_dumps = json.dumps
    calls = {"n": 0}

    def failing_dumps(obj):
        calls["n"] += 1
        if calls["n"] > 500:  # eval (200 rows) succeeds, train dies part-way
            raise KeyboardInterrupt
        return real_dumps(obj)

    monkeypatch.setattr(arith.json, "dumps", failing_dumps)
    with pytest.raises(KeyboardInterrupt):
        ensure_arith_data(str(tmp_path), n_train=1000, n_eval=200)
    (folder,) = tmp_path.iterdir()
    assert sorted(p.name for p in folder.iterdir()) == ["eval.jsonl"]  # no train, no temp file
    monkeypatch.undo()
    train_path, _ = ensure_arith_data(str(tmp_path), n_train=1000, n_eval=200)
    assert len(_read(train_path)) == 1000
