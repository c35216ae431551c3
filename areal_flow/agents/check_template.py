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

Exit status 0 when nothing drifts, 1 when something does, 2 when the model has no chat template.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any

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


def check(tokenizer: Any, conversations: dict[str, tuple[list[dict], list[dict]]] = CONVERSATIONS) -> list[Drift]:
    """The drifts of `tokenizer`'s chat template over `conversations` (none: safe to train on)."""
    drifts = []
    for name, (messages, tools) in conversations.items():
        drifts += _check_one(tokenizer, name, messages, tools)
    return drifts


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m areal_flow.agents.check_template", description=__doc__.split("\n")[0])
    parser.add_argument("model_path", help="a model directory (or just its tokenizer files)")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    if not getattr(tokenizer, "chat_template", None):
        print(f"{args.model_path}: the tokenizer has no chat template", file=sys.stderr)
        return 2
    drifts = check(tokenizer)
    for drift in drifts:
        print(f"drift: {drift}")
    calls = sum(m["role"] == "assistant" for messages, _ in CONVERSATIONS.values() for m in messages)
    print(f"{args.model_path}: {len(CONVERSATIONS)} conversations, {calls} calls, {len(drifts)} drifts")
    return 1 if drifts else 0


if __name__ == "__main__":
    sys.exit(main())
