"""An agent's text mapped back onto the tokens it stands for (`/v1/completions` through the gateway).

An agent written from OpenAI's documentation sends its history back as text: the prompt it sent,
each answer's `text`, what it added. That text is not the tokens the policy produced: OpenAI's
`text` leaves out the stop string that ended the answer, and special tokens the policy sampled
(`skip_special_tokens`, true by default on SGLang and vLLM, has no field in OpenAI's API); and text
tokenized again may split differently. Each is a drift (trajectories.py), and the rollout would
train on its last segment alone.

So the gateway tokenizes a rollout's text prompts itself, through this map: every prompt it sent
and every answer it got is known with its exact tokens, under the text the agent saw (the prompt +
the answer's `text`) and under the text the tokens decode to (special tokens and stop string
included). A prompt that starts with a known text takes that text's tokens, and only the rest (what
the agent added) is tokenized; the longest known text wins. What the server computes the next
answer on, what is recorded and what is trained are then the policy's own tokens, whatever the
agent did with their text.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class TextMap:
    """The texts one rollout sent and got, each with the tokens it stands for."""

    prompts: dict[str, tuple[int, ...]] = field(default_factory=dict)  # each prompt sent
    answers: dict[str, tuple[int, ...]] = field(default_factory=dict)  # each prompt + an answer to it

    def tokens(self, prompt: str, encode: Callable[[str], list[int]]) -> list[int]:
        """`prompt`'s tokens. A prompt sent before is asked again (another sample of that turn): its
        tokens. Else the known text it starts with (the longest; an answer's before a prompt's of
        the same text: an empty answer that ended at a special token is still the policy's), then
        the rest encoded."""
        if prompt in self.prompts:
            return list(self.prompts[prompt])
        known = [(len(t), True, t) for t in self.answers if prompt.startswith(t)] + \
                [(len(t), False, t) for t in self.prompts if prompt.startswith(t)]
        if not known:
            return encode(prompt)
        _, answer, text = max(known)
        rest = prompt[len(text):]
        return [*(self.answers if answer else self.prompts)[text], *(encode(rest) if rest else ())]

    def learn(self, prompt: str, prompt_ids: list[int], answers: list[tuple[str, str, list[int]]]) -> None:
        """A call: the text `prompt` sent as `prompt_ids`, and each answer as (the text it gave, the
        text its tokens decode to, its tokens)."""
        self.prompts[prompt] = tuple(prompt_ids)
        for given, decoded, ids in answers:
            whole = (*prompt_ids, *ids)
            self.answers[prompt + decoded] = whole
            self.answers.setdefault(prompt + given, whole)  # an earlier answer's exact text is kept
