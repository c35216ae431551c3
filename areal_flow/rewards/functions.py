"""The reward functions a reward node can name with `fn:`. Each maps (completion text, reference
answer) to a float, or to a dict of figures with the same keys on every call (`reward` and what
becomes a per-node metric); they run inside reward worker processes (math-verify needs a main
thread)."""

from __future__ import annotations

import re
from typing import Callable

from areal_flow.data.arith import arith_reward, extract_answer
from areal_flow.rewards.math import math_figures

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def arith_format_reward(completion: str, answer: str) -> float:
    """1.0 when the completion ends in a final-answer line `#### N` that parses, right or wrong:
    a shaping reward to weigh beside `arith` with a combine node."""
    return 1.0 if extract_answer(completion) is not None else 0.0


def judge_reward(completion: str, verdict: str) -> dict[str, float]:
    """The judge's verdict as the reward: the last number after its last `####` (a prompt asking
    for `#### 1`/`#### 0`, or a 0-10 score to shape with `scale`); 0, counted as `unparsed`, when
    there is none. The completion is the judge's to read, not this function's."""
    _, sep, tail = verdict.rpartition("####")
    found = _NUMBER.findall(tail) if sep else []
    return {"reward": float(found[-1]) if found else 0.0, "unparsed": 0.0 if found else 1.0}


def judge_agree(completion: str, verdict: str) -> dict[str, float]:
    """1 when the completion's final answer `#### N` equals the judge's (a judge that solves the
    question itself); `unparsed` counts verdicts with no answer."""
    theirs = extract_answer(verdict)
    mine = extract_answer(completion)
    return {"reward": float(theirs is not None and mine == theirs), "unparsed": float(theirs is None)}


REWARD_FNS: dict[str, Callable[[str, str], "float | dict[str, float]"]] = {
    "arith": arith_reward,
    "arith_format": arith_format_reward,
    "math": math_figures,  # {"reward", "suspect"}: suspect is 1.0 for an answer refused as a hedge
    "judge": judge_reward,
    "judge_agree": judge_agree,
}
