"""An agent's chat history mapped back onto the tokens it stands for (`/v1/chat/completions`
through the gateway).

An agent written from OpenAI's documentation sends its whole conversation again at each call, the
assistant's answers as the messages it got back. The server would render them through the chat
template, and that text is not the tokens the policy produced: the template writes a tool call's
JSON its own way (the policy may have spaced it otherwise), drops special tokens and text the
answer's parsing left out, and ends the turn with its own end-of-turn text where the policy
stopped at an eos token. Each is a drift (trajectories.py), and the rollout would train on its
last segment alone.

So the gateway keeps, for a rollout, every conversation it sent with its prompt tokens and every
assistant message it returned with the exact tokens of that answer. A call whose messages start
with a known conversation followed by one of its answers (compared as the template reads them:
roles, text, tool calls by name and arguments) takes that answer's tokens, then the rest: what the
template adds after an assistant turn's content (`<|im_end|>\\n`; the part of it the policy
generated, its eos, is not added twice) and the messages the agent added (tool results, the next
user message) rendered as the template renders them. The longest such start wins; a conversation
sent before is its own tokens. The gateway sends the result as the call's `prompt_token_ids`
(docs/generation.md). Where no known start matches, or the template renders the earlier turns
differently once more messages follow (it rewrites history), the server renders the messages as
usual and the recorder counts any drift.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

SENTINEL = "\x00areal-flow-turn-end\x00"


@dataclass
class _Conversation:
    messages: list[str]  # each message as the template reads it, canonical JSON
    tools: str
    prompt_ids: tuple[int, ...]
    answers: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)  # (message, prompt + answer ids)


@dataclass
class ChatMap:
    """The conversations one rollout sent and the answers it got, each with its tokens."""

    tokenizer: Any
    conversations: list[_Conversation] = field(default_factory=list)

    def tokens(self, messages: Any, tools: Any) -> list[int] | None:
        """The conversation's tokens, or None where the server should render it (nothing known
        starts it, the request is malformed: the server says how, or the template rewrites it)."""
        shaped = _shaped(messages, tools)
        if shaped is None:
            return None
        msgs, tools_ = shaped
        keys, tools_key = [_key(m) for m in msgs], _key(tools_)
        best: tuple[int, tuple[int, ...]] | None = None
        for c in self.conversations:
            n = len(c.messages)
            if c.tools != tools_key or keys[:n] != c.messages:
                continue
            if n == len(keys):
                return list(c.prompt_ids)  # asked again: another sample of that turn
            for message, ids in c.answers:
                if keys[n] == message and (best is None or n + 1 > best[0]):
                    best = (n + 1, ids)
        if best is None:
            return None
        j, ids = best
        head, whole = self._render(msgs[:j], tools_, False), self._render(msgs, tools_, True)
        end = self._render([*msgs[:j - 1], {"role": "assistant", "content": SENTINEL}], tools_, False)
        if head is None or whole is None or end is None or not whole.startswith(head) or SENTINEL not in end:
            return None
        end = end[end.index(SENTINEL) + len(SENTINEL):]  # what the template writes after an answer
        last = self.tokenizer.decode(list(ids[-1:]), skip_special_tokens=False)
        glue = end[len(last):] if last and end.startswith(last) else end
        rest = glue + whole[len(head):]
        return [*ids, *(self.tokenizer.encode(rest, add_special_tokens=False) if rest else ())]

    def learn(self, messages: Any, tools: Any, prompt_ids: list[int], answers: list[tuple[dict, list[int]]]) -> None:
        """A call: `messages` sent as `prompt_ids`, and each answer as (the message the gateway
        returned, its tokens)."""
        shaped = _shaped(messages, tools)
        if shaped is None:
            return
        msgs, tools_ = shaped
        keys, tools_key = [_key(m) for m in msgs], _key(tools_)
        conversation = next((c for c in self.conversations if c.messages == keys and c.tools == tools_key), None)
        if conversation is None:
            conversation = _Conversation(keys, tools_key, tuple(prompt_ids))
            self.conversations.append(conversation)
        for message, ids in answers:
            answered = _shaped([message], None)
            if answered is not None:
                conversation.answers.append((_key(answered[0][0]), (*conversation.prompt_ids, *ids)))

    def _render(self, msgs: list[dict], tools: list[dict], prompt: bool) -> str | None:
        try:
            return self.tokenizer.apply_chat_template(msgs, tools=tools or None, add_generation_prompt=prompt,
                                                      tokenize=False)
        except Exception:  # noqa: BLE001 - a template that refuses a part: the server renders the whole
            return None


def _shaped(messages: Any, tools: Any) -> tuple[list[dict], list[dict]] | None:
    """The messages and tools as the server's template reads them; None when malformed."""
    # Imported here: the server's module loads torch, which a rollout worker without chat agents
    # never needs (agents/resume.py imports it the same way).
    from areal_flow.generation.http.errors import HTTPError
    from areal_flow.generation.http.openai_api import chat_input

    try:
        return chat_input(messages, tools)
    except HTTPError:
        return None


def _key(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False)
