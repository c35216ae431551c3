"""What the supervised bootstrap teaches a tiny model: a task's characters and its fresh
(prompt, completion) pairs, never a held-out prompt.

`ensure_base_model(task=...)` names one of TASKS; its settings (and so its cache directory) hold the
task's characters and data version, so a change to either trains a new model.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Callable, Iterator

from areal_flow.data import arith, tiny_code
from areal_flow.models.tokenizer import CHARS, CODE_CHARS


@dataclasses.dataclass(frozen=True)
class BootstrapTask:
    """A task the bootstrap can train on."""

    name: str
    chars: str  # the character tokenizer's characters
    chat: bool  # the tokenizer carries the chat template
    data_version: int  # the task's DATA_VERSION: new data, new model
    # (seed, (n_eval, eval_seed)) -> endless fresh (prompt, completion) pairs, none of them held out
    pairs: Callable[[int, tuple[int, int]], Iterator[tuple[str, str]]]


def arith_pairs(seed: int, heldout: tuple[int, int]) -> Iterator[tuple[str, str]]:
    """Fresh arithmetic problems as (prompt, scratchpad completion), the held-out prompts excluded."""
    excluded = {arith.prompt_text(a, b) for a, b in arith.heldout_problems(*heldout)}
    rng = random.Random(f"bootstrap-{seed}")  # the stream the bootstrap has always drawn
    while True:
        a, b = arith.sample_operands(rng)
        prompt = arith.prompt_text(a, b)
        if prompt not in excluded:
            yield prompt, arith.completion_text(a, b)


def code_pairs(seed: int, heldout: tuple[int, int]) -> Iterator[tuple[str, str]]:
    """Fresh tiny_code problems as (prompt, reference function), no held-out identity among them."""
    for problem in tiny_code.training_problems(seed, heldout, stream="bootstrap"):
        yield problem.prompt, problem.solution


TASKS: dict[str, BootstrapTask] = {
    "tiny_arith": BootstrapTask("tiny_arith", CHARS, False, arith.DATA_VERSION, arith_pairs),
    "tiny_code": BootstrapTask("tiny_code", CODE_CHARS, True, tiny_code.DATA_VERSION, code_pairs),
}
"""The bootstrap's tasks by `dataset.name`."""


def bootstrap_task(name: str) -> BootstrapTask:
    """The task a dataset's tiny model is bootstrapped on: its own where it has one, else arithmetic
    (the sample sets' recipes run the path with the arithmetic model)."""
    return TASKS.get(name, TASKS["tiny_arith"])
