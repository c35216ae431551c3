"""What the supervised bootstrap teaches a tiny model: a task's characters and its fresh
(prompt, completion) pairs, never a held-out prompt.

`ensure_base_model(task=...)` names one of TASKS; its settings (and so its cache directory) hold the
task's characters and data version, so a change to either trains a new model.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import random
import re
from typing import Callable, Iterator, Union

from areal_flow.data import arith, tiny_code
from areal_flow.data.observations import (
    OUTPUT_CLOSE,
    OUTPUT_OPEN,
    PYTHON_CLOSE,
    PYTHON_FUNCTION,
    PYTHON_OPEN,
    call_text,
    failed_test,
    output_observation,
)
from areal_flow.models.tokenizer import CHARS, CODE_CHARS, EOS, IM_END, IM_START, TOOLS_INSTRUCTION, TOOLS_PREAMBLE

HELDOUT_N, HELDOUT_SEED = 200, 0
"""The held-out set the bootstrap must never train on: the default one of `ensure_arith_data`."""

Completion = Union[str, list[tuple[str, bool]]]
"""A reference completion: its text, or its parts as (text, trained): a tool's answer is not trained."""


@dataclasses.dataclass(frozen=True)
class BootstrapTask:
    """A task the bootstrap can train on."""

    name: str
    chars: str  # the character tokenizer's characters
    chat: bool  # the tokenizer carries the chat template
    data_version: int  # the task's DATA_VERSION: new data, new model
    # (seed, (n_eval, eval_seed)) -> endless fresh (prompt, completion) pairs, none of them held out
    pairs: Callable[[int, tuple[int, int]], Iterator[tuple[str, Completion]]]
    words: tuple[str, ...] = ()  # strings the tokenizer holds as one token each (a tool call's tags)
    eos: str = EOS  # the token that ends an answer (IM_END: a chat model's turn, as Qwen's instruct models)


def arith_pairs(seed: int, heldout: tuple[int, int]) -> Iterator[tuple[str, str]]:
    """Fresh arithmetic problems as (prompt, scratchpad completion), the held-out prompts excluded."""
    excluded = {arith.prompt_text(a, b) for a, b in arith.heldout_problems(*heldout)}
    rng = random.Random(f"bootstrap-{seed}")  # the stream the bootstrap has always drawn
    while True:
        a, b = arith.sample_operands(rng)
        prompt = arith.prompt_text(a, b)
        if prompt not in excluded:
            yield prompt, arith.completion_text(a, b)


TOOL_WORDS = (PYTHON_OPEN, PYTHON_CLOSE, OUTPUT_OPEN, OUTPUT_CLOSE)  # python_tool's default tags, one token each
TOOL_SHARE = 0.3  # of the bootstrap's problems answered with the tool, whatever their length


def tool_completion(a: int, b: int) -> list[tuple[str, bool]]:
    """a+b answered with python_tool: the call, the observation the tool gives back (untrained),
    then the answer, e.g. `<python>print(12+345)</python>`, `\\n<output>\\n357\\n\\n</output>\\n`, `#### 357`."""
    call = f"{PYTHON_OPEN}print({a}+{b}){PYTHON_CLOSE}"
    return [(call, True), (output_observation(f"{a + b}\n"), False), (f"#### {a + b}", True)]


def arith_tool_pairs(seed: int, heldout: tuple[int, int]) -> Iterator[tuple[str, Completion]]:
    """tiny_arith's problems, TOOL_SHARE of them answered with the Python tool and the others with
    the scratchpad: RL decides when the tool pays (the problem stream is arith_pairs')."""
    rng = random.Random(f"bootstrap-tool-{seed}")
    for prompt, scratchpad in arith_pairs(seed, heldout):
        if rng.random() < TOOL_SHARE:
            yield prompt, tool_completion(*arith.operands(prompt))
        else:
            yield prompt, scratchpad


CALL_HEAD, CALL_TAIL = '{"name": "python", "arguments": {"code": "', '"}}'  # a call as the template writes it
CHAT_TOOL_WORDS = (
    # The tool's declaration the template writes into the system turn (HF's `tojson`: json.dumps),
    # and the call's and the result's tags and JSON around the code: one token each, so that a chat
    # prompt is about as long as tiny_arith_tool's (a character tokenizer would make it 400 tokens).
    # The template's `{% endfor %}` eats the newline that starts TOOLS_INSTRUCTION (trim_blocks).
    TOOLS_PREAMBLE, json.dumps(PYTHON_FUNCTION, ensure_ascii=False), TOOLS_INSTRUCTION.removeprefix("\n"), "<tool_call>",
    "</tool_call>", "<tool_response>", "</tool_response>", CALL_HEAD, CALL_TAIL,
    # Each role's name one token, as in Qwen's vocabulary: a tool's result is then a few tokens from
    # where the answer copies it (spelled out, the 600k-parameter model copied it wrong twice as often).
    "system\n", "user\n", "assistant\n")


@functools.cache
def _chat_renderer():
    from areal_flow.models.tokenizer import build_char_tokenizer

    return build_char_tokenizer(CODE_CHARS, chat=True)


def chat_prompt(problem: str) -> str:
    """A chat agent's first prompt for `problem`: the Python tool declared, the problem as the
    user's turn, the assistant's turn begun (the template's text, as the server renders it)."""
    return _chat_renderer().apply_chat_template([{"role": "user", "content": problem}], tools=[PYTHON_FUNCTION],
                                                add_generation_prompt=True, tokenize=False)


def chat_tool_completion(a: int, b: int) -> list[tuple[str, bool]]:
    """a+b answered by a chat agent with the Python tool: the call ending the turn, the tool's result
    as the next conversation renders it after that turn (the newline the template ends a turn with,
    the tool's turn, the assistant's begun; untrained), then the answer."""
    call = f"<tool_call>\n{CALL_HEAD}print({a}+{b}){CALL_TAIL}\n</tool_call>{IM_END}"
    result = f"\n{IM_START}user\n<tool_response>\n{a + b}\n\n</tool_response>{IM_END}\n{IM_START}assistant\n"
    return [(call, True), (result, False), (f"#### {a + b}", True)]


def arith_chat_tool_pairs(seed: int, heldout: tuple[int, int]) -> Iterator[tuple[str, Completion]]:
    """arith_tool_pairs' problems as a chat agent asks them (`chat_prompt`), TOOL_SHARE answered with a
    tool call (`chat_tool_completion`), the others with the scratchpad; each answer ends its turn."""
    rng = random.Random(f"bootstrap-chat-tool-{seed}")
    for prompt, scratchpad in arith_pairs(seed, heldout):
        if rng.random() < TOOL_SHARE:
            yield chat_prompt(prompt), chat_tool_completion(*arith.operands(prompt))
        else:
            yield chat_prompt(prompt), scratchpad


CHECK_SHARE = 0.5  # of the two-agent bootstrap's pairs that are a checker's, half of them wrong claims


def wrong_claim(total: int, rng: random.Random) -> int:
    """The sum with one digit changed: the slip a solver makes (a carry lost, a digit misread)."""
    digits = list(str(total))
    i = rng.randrange(len(digits))
    choices = [d for d in "0123456789" if d != digits[i] and not (i == 0 and d == "0" and len(digits) > 1)]
    digits[i] = rng.choice(choices)
    return int("".join(digits))


def arith_check_pairs(seed: int, heldout: tuple[int, int]) -> Iterator[tuple[str, str]]:
    """tiny_arith's problems for a solver and a checker of one policy (the two-agent example):
    CHECK_SHARE of them become a checker's (`check a+b=c`, the sum worked out, then yes or no),
    their claims right or wrong by halves; the others stay the solver's (arith_pairs' stream)."""
    rng = random.Random(f"bootstrap-check-{seed}")
    for prompt, scratchpad in arith_pairs(seed, heldout):
        if rng.random() >= CHECK_SHARE:
            yield prompt, scratchpad
            continue
        a, b = arith.operands(prompt)
        claim = a + b if rng.random() < 0.5 else wrong_claim(a + b, rng)
        yield arith.check_prompt_text(a, b, claim), arith.check_completion_text(a, b, claim)


def code_pairs(seed: int, heldout: tuple[int, int]) -> Iterator[tuple[str, str]]:
    """Fresh tiny_code problems as (prompt, reference function), no held-out identity among them."""
    for problem in tiny_code.training_problems(seed, heldout, stream="bootstrap"):
        yield problem.prompt, problem.solution


REPAIR_SHARE = 0.3  # of the bootstrap's code problems first attempted wrong, then repaired after the failed test
_NUMBER = re.compile(r"(?<![\w.])\d+(?![\w.])")
# A slip of the kind a model makes, where the body has no number to get wrong.
_SWAPS = ((" + ", " - "), (" - ", " + "), (" < ", " > "), (" > ", " < "), (" <= ", " < "), (" >= ", " > "),
          (" == ", " != "), ("max(", "min("), ("min(", "max("), (".upper()", ".lower()"), (".lower()", ".upper()"),
          ("[::-1]", ""), (" and ", " or "), (" or ", " and "))


def slip(solution: str, rng: random.Random) -> str:
    """The reference with one slip in its body: a number off by one, else an operator swapped
    (unchanged when it has neither)."""
    head, _, body = solution.partition("\n")
    numbers = list(_NUMBER.finditer(body))
    if numbers:
        m = rng.choice(numbers)
        n = int(m.group())
        wrong = n + 1 if n == 0 or rng.random() < 0.5 else n - 1
        return f"{head}\n{body[:m.start()]}{wrong}{body[m.end():]}"
    swaps = [(a, b) for a, b in _SWAPS if a in body]
    if not swaps:
        return solution
    a, b = rng.choice(swaps)
    return f"{head}\n{body.replace(a, b, 1)}"


def first_failure(program: str, problem: tiny_code.Problem) -> tuple[int, str] | None:
    """What code_feedback reports for `program` on the tests `problem`'s prompt shows: (the first
    failing test, what it gave), or None. Run here, in this process: the program is one of ours."""
    scope: dict = {"__name__": "solution"}
    exec(compile(program, "solution.py", "exec"), scope)
    fn = scope[problem.spec.name]
    for i, (args, want) in enumerate(zip(problem.inputs[:problem.shown], problem.outputs[:problem.shown])):
        try:
            got = fn(*json.loads(json.dumps(list(args))))
        except Exception as e:
            return i, f"{type(e).__name__}: {e}"
        if json.loads(json.dumps(got)) != json.loads(json.dumps(want)):
            return i, repr(got)
    return None


def repaired(problem: tiny_code.Problem, rng: random.Random) -> list[tuple[str, bool]] | None:
    """A wrong first attempt (the reference with a slip), the shown test it fails as code_feedback
    writes it (untrained), then the reference; None when the slip passes every shown test."""
    wrong = slip(problem.solution, rng)
    failed = first_failure(wrong, problem) if wrong != problem.solution else None
    if failed is None:
        return None
    i, got = failed
    args, want = json.loads(json.dumps([list(problem.inputs[i]), problem.outputs[i]]))
    return [(wrong + EOS, True), (failed_test(call_text(problem.spec.name, args), want, got), False),
            (problem.solution, True)]


def code_feedback_pairs(seed: int, heldout: tuple[int, int]) -> Iterator[tuple[str, Completion]]:
    """tiny_code's bootstrap problems (code_pairs' stream), REPAIR_SHARE of them attempted wrong
    first and repaired after the failed test, each attempt ending in EOS as a turn does."""
    rng = random.Random(f"bootstrap-repair-{seed}")
    for problem in tiny_code.training_problems(seed, heldout, stream="bootstrap"):
        parts = repaired(problem, rng) if rng.random() < REPAIR_SHARE else None
        yield problem.prompt, parts or problem.solution


TASKS: dict[str, BootstrapTask] = {
    "tiny_arith": BootstrapTask("tiny_arith", CHARS, False, arith.DATA_VERSION, arith_pairs),
    "tiny_arith_tool": BootstrapTask("tiny_arith_tool", CODE_CHARS, False, arith.DATA_VERSION, arith_tool_pairs,
                                     words=TOOL_WORDS),
    "tiny_arith_chat_tool": BootstrapTask("tiny_arith_chat_tool", CODE_CHARS, True, arith.DATA_VERSION,
                                          arith_chat_tool_pairs, words=CHAT_TOOL_WORDS, eos=IM_END),
    "tiny_arith_check": BootstrapTask("tiny_arith_check", CODE_CHARS, False, arith.DATA_VERSION, arith_check_pairs),
    "tiny_code": BootstrapTask("tiny_code", CODE_CHARS, True, tiny_code.DATA_VERSION, code_pairs),
    # Version 2 of its traces: the failed test is one the prompt shows (code_feedback's feedback_from=shown).
    "tiny_code_feedback": BootstrapTask("tiny_code_feedback", CODE_CHARS, True, tiny_code.DATA_VERSION + 1,
                                        code_feedback_pairs),
}
"""The bootstrap's tasks by name: a dataset's own (`dataset.name`), or `model.bootstrap_task`."""


def bootstrap_task(name: str) -> BootstrapTask:
    """The task a dataset's tiny model is bootstrapped on: its own where it has one, else arithmetic
    (the sample sets' recipes run the path with the arithmetic model)."""
    return TASKS.get(name, TASKS["tiny_arith"])
