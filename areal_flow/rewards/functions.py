"""The reward functions a reward node can name with `fn:`. Each maps (completion text, reference
answer) to a float; they run inside reward worker processes (math-verify needs a main thread)."""

from __future__ import annotations

from typing import Callable

from areal_flow.data.arith import arith_reward, extract_answer
from areal_flow.rewards.math import math_reward


def arith_format_reward(completion: str, answer: str) -> float:
    """1.0 when the completion ends in a final-answer line `#### N` that parses, right or wrong:
    a shaping reward to weigh beside `arith` with a combine node."""
    return 1.0 if extract_answer(completion) is not None else 0.0


REWARD_FNS: dict[str, Callable[[str, str], float]] = {
    "arith": arith_reward,
    "arith_format": arith_format_reward,
    "math": math_reward,
}
