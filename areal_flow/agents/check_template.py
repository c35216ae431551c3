"""Does a chat template keep the tokens an agent's calls were made of?

An agent sends a conversation, the server answers, the agent appends the answer and a tool result
and sends the whole conversation again. Training on such a trajectory needs the second call's prompt
tokens to *extend* the first call's prompt and answer tokens exactly. Two things break that:
- the template rewrites history: the rendered conversation is no longer a prefix of the next render
  (templates that drop earlier reasoning, move the system prompt, or re-indent tool calls);
- the tokenizer merges across a boundary: text tokenized piece by piece (prompt, then answer, then
  what follows) differs from the same text tokenized whole (BPE merges over the seam).

This renders multi-turn, tool-calling conversations through a model's template and tokenizer and
reports each place where the incremental tokens and the full render disagree: the conversation, the
call, the first differing position and the text around it.

    python -m areal_flow.agents.check_template MODEL_PATH

A template that refuses a conversation (Mistral's "roles must alternate", which has no tool turns)
cannot be checked on it: that is said in one line per conversation, and the others are checked.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from typing import Any

EXIT_CODES = """exit status:
  0  checked: no drift
  1  drift: some call's tokens differ from the full render (each is printed)
  2  cannot check: no model or tokenizer at MODEL_PATH, no chat template, or the template refuses
     a conversation (and no drift in the others); a one-line reason on stderr"""

PYTHON_TOOL = {"type": "function", "function": {
    "name": "python", "description": "Run Python code and read what it printed.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}


def _call(code: str) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [{"name": "python", "arguments": {"code": code}}]}


CONVERSATIONS: dict[str, tuple[list[dict], list[dict]]] = {
    # name -> (messages, tools); every assistant message is an answer the model produced.
    "two turns": ([{"role": "user", "content": "What is 12+30?"}, {"role": "assistant", "content": "42"},
                   {"role": "user", "content": "And 42+1?"}, {"role": "assistant", "content": "43"}], []),
    "system and three turns": ([{"role": "system", "content": "Answer with a number."},
                                {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                                {"role": "user", "content": "times 3?"}, {"role": "assistant", "content": "12"},
                                {"role": "user", "content": "minus 5?"}, {"role": "assistant", "content": "7"}], []),
    "a tool call and its result": ([{"role": "user", "content": "Compute 123456+654321."},
                                    _call("print(123456+654321)"), {"role": "tool", "content": "777777\n"},
                                    {"role": "assistant", "content": "#### 777777"}], [PYTHON_TOOL]),
    "two tool calls": ([{"role": "system", "content": "Use the tool."}, {"role": "user", "content": "Sum 1..10?"},
                        _call("print(sum(range(11)))"), {"role": "tool", "content": "55\n"},
                        _call("print(55 * 2)"), {"role": "tool", "content": "110\n"},
                        {"role": "assistant", "content": "55, and twice that is 110."}], [PYTHON_TOOL]),
}


@dataclass(frozen=True)
class Drift:
    """One call of a conversation whose incremental tokens differ from the full render's."""

    conversation: str
    call: int  # the k-th model call (0-based): the assistant message it produced
    kind: str  # "history rewritten" (text) or "tokens differ at the seam" (tokenization)
    position: int  # first differing character (text) or token (tokens)
    context: str  # the text around it

    def __str__(self) -> str:
        return f"{self.conversation}, call {self.call}: {self.kind} at {self.position}: {self.context!r}"


@dataclass
class Report:
    """What checking a template found: its drifts, and the conversations it refuses to render."""

    drifts: list[Drift] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)
    """conversation -> the template's reason (jinja's TemplateError, e.g. raise_exception's message)."""


def check(tokenizer: Any, conversations: dict[str, tuple[list[dict], list[dict]]] = CONVERSATIONS) -> list[Drift]:
    """The drifts of `tokenizer`'s chat template over `conversations` (none: safe to train on).
    Raises jinja2.TemplateError when the template refuses a conversation (`check_all` goes on)."""
    drifts = []
    for name, (messages, tools) in conversations.items():
        drifts += _check_one(tokenizer, name, messages, tools)
    return drifts


def check_all(tokenizer: Any, conversations: dict[str, tuple[list[dict], list[dict]]] = CONVERSATIONS) -> Report:
    """`check` over every conversation the template renders, and the reasons of those it refuses."""
    from jinja2 import TemplateError, TemplateSyntaxError

    report = Report()
    for name, (messages, tools) in conversations.items():
        try:
            report.drifts += _check_one(tokenizer, name, messages, tools)
        except TemplateSyntaxError:
            raise  # the template itself is broken: main() says so
        except TemplateError as exc:
            report.refused[name] = " ".join(str(exc).split())  # one line
    return report


def render(tokenizer: Any, messages: list[dict], tools: list[dict], prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=prompt, tokenize=False)


def _check_one(tokenizer: Any, name: str, messages: list[dict], tools: list[dict]) -> list[Drift]:
    """Replay the conversation call by call as an agent would, recording tokens as a server does:
    each call's prompt is the next render; the recorded trajectory is the first prompt, then each
    answer and each next prompt's new part, tokenized piece by piece."""
    calls = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    drifts, recorded_text, recorded = [], "", []
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    for k, i in enumerate(calls):
        prompt = render(tokenizer, messages[:i], tools, prompt=True)
        if not prompt.startswith(recorded_text):
            at = _first_difference(prompt, recorded_text)
            drifts.append(Drift(name, k, "history rewritten", at, prompt[max(0, at - 30): at + 30]))
            return drifts  # later calls would all differ from here
        recorded += encode(prompt[len(recorded_text):])
        whole = encode(prompt)
        if whole != recorded:
            at = _first_difference(whole, recorded)
            drifts.append(Drift(name, k, "tokens differ at the seam", at, tokenizer.decode(whole[max(0, at - 8): at + 8])))
            recorded = whole  # report each seam once
        # The answer as the model wrote it: what the full render adds after the prompt for this message.
        answered = render(tokenizer, messages[: i + 1], tools, prompt=False)
        if not answered.startswith(prompt):
            at = _first_difference(answered, prompt)
            drifts.append(Drift(name, k, "history rewritten", at, answered[max(0, at - 30): at + 30]))
            return drifts
        recorded += encode(answered[len(prompt):])
        recorded_text = answered
    return drifts


def _first_difference(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""Files of which a model directory holds at least one when a tokenizer can be loaded from it."""

CHECKED, DRIFT, CANNOT_CHECK = 0, 1, 2
"""The exit statuses (EXIT_CODES); argparse's usage errors are 2 as well: nothing was checked."""


def load(path: str) -> Any:
    """The tokenizer at `path`; ValueError with a one-line reason when there is none. A path that
    is not on disk and cannot be a Hub id ("org/name") is not looked up on the Hub."""
    from transformers import AutoTokenizer

    hub_id = not os.path.isabs(path) and not path.startswith((".", "~")) and path.count("/") <= 1
    if not os.path.exists(path) and not hub_id:
        raise ValueError("no such directory")
    if os.path.isdir(path) and not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        raise ValueError(f"the directory has no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...)")
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if not os.path.exists(path):
            raise ValueError(f"no such directory, and no model of that name on the Hugging Face Hub ({why})") from None
        raise ValueError(f"no tokenizer could be loaded from it ({why})") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m areal_flow.agents.check_template",
                                     description=__doc__.split("\n")[0], epilog=EXIT_CODES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_path", metavar="MODEL_PATH",
                        help="a model directory (or just its tokenizer files), or a Hub id")
    args = parser.parse_args(argv)
    from jinja2 import TemplateSyntaxError

    path = args.model_path
    try:
        tokenizer = load(path)
    except ValueError as exc:
        print(f"{path}: cannot check: {exc}", file=sys.stderr)
        return CANNOT_CHECK
    if not getattr(tokenizer, "chat_template", None):
        print(f"{path}: cannot check: the tokenizer has no chat template", file=sys.stderr)
        return CANNOT_CHECK
    try:
        report = check_all(tokenizer)
    except TemplateSyntaxError as exc:
        print(f"{path}: cannot check: the chat template does not compile: {' '.join(str(exc).split())}",
              file=sys.stderr)
        return CANNOT_CHECK
    for drift in report.drifts:
        print(f"drift: {drift}")
    for name, why in report.refused.items():
        print(f"{path}: cannot check {name!r}: the template refuses it: {why}", file=sys.stderr)
    checked = {name: c for name, c in CONVERSATIONS.items() if name not in report.refused}
    calls = sum(m["role"] == "assistant" for messages, _ in checked.values() for m in messages)
    refused = f" ({len(report.refused)} refused by the template)" if report.refused else ""
    print(f"{path}: {len(checked)} conversations{refused}, {calls} calls, {len(report.drifts)} drifts")
    if report.drifts:
        return DRIFT
    return CANNOT_CHECK if report.refused else CHECKED


if __name__ == "__main__":
    sys.exit(main())
