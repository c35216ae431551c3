"""One sample as it was generated, token in and token out: the one shape every way of rolling out
gives the rollout worker, which turns it into the wire's `Sample` once.

A trajectory is its prompt, then the policy's answers (loss mask 1, each token with its behaviour
logprob and the weight version that made it) and what came between them: an environment's
observation, a tool's result, the next message an agent added (loss mask 0, behaviour logprob 0.0,
the version of the answer before it; no policy made them). A one-turn sample is one answer
(rollout/requests.py); an environment's trajectory appends turns and observations
(rollout/turns.py); an agent's calls are linked into trajectories by the gateway's recorder
(agents/trajectories.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from areal_flow.transport.messages import Finish, Served


@dataclass
class Trajectory:
    """The tokens of one sample and their per-token record, with what the sample says of itself."""

    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)  # answers (mask 1) and what came between (mask 0)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # behaviour logprobs; 0.0 on observation tokens
    versions: list[int] = field(default_factory=list)  # per token; an observation takes the answer's before it
    answer_starts: list[int] = field(default_factory=list)  # where each answer starts in `tokens`
    finish: Finish = Finish.STOP  # LENGTH when its last answer was cut at its length budget
    scalars: dict[str, float] = field(default_factory=dict)  # per-sample numbers (env/..., agent/...)
    error: str | None = None  # what the user's code raised that ended it (an environment's `step`)
    drift: dict[str, Any] | None = None  # an agent's first drift, shown in the sample dump
    served: list[Served] = field(default_factory=list)  # the servers' accounts of its answers' requests

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def n_tokens(self) -> int:
        """Its tokens, prompt included, without building the list `tokens` is (a property, not
        __len__: an empty trajectory stays truthy)."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def calls(self) -> int:
        """The policy's answers in it: turns, or an agent's calls."""
        return len(self.answer_starts)

    def observe(self, tokens: list[int], version: int = 0) -> None:
        """Tokens no policy wrote: loss mask 0, no behaviour logprob, the version of the answer
        before them (`version` when there is none yet)."""
        version = self.versions[-1] if self.versions else version
        self.output_ids += tokens
        self.loss_mask += [0] * len(tokens)
        self.logprobs += [0.0] * len(tokens)
        self.versions += [version] * len(tokens)

    def answer(self, tokens: list[int], logprobs: list[float], versions: list[int]) -> None:
        """The policy's answer: loss mask 1, its logprobs and versions."""
        self.answer_starts.append(len(self.prompt_ids) + len(self.output_ids))
        self.output_ids += tokens
        self.loss_mask += [1] * len(tokens)
        self.logprobs += logprobs
        self.versions += versions

    def answered(self, turn: dict) -> None:
        """A `/generate` answer (rollout/requests.py: output_ids, behav_logprobs, versions, finish)."""
        self.answer(list(turn["output_ids"]), list(turn["behav_logprobs"]), list(turn["versions"]))
        self.finish = turn["finish"]
        self.served += turn.get("served", ())

    @classmethod
    def one_turn(cls, prompt_ids: list[int], turn: dict) -> "Trajectory":
        """A sample of one answer."""
        trajectory = cls(list(prompt_ids))
        trajectory.answered(turn)
        return trajectory

    def cut(self, end: int) -> "Trajectory":
        """A copy of its first `end` tokens (at the start of an answer: a fork point)."""
        kept = end - len(self.prompt_ids)
        return Trajectory(list(self.prompt_ids), self.output_ids[:kept], self.loss_mask[:kept], self.logprobs[:kept],
                          self.versions[:kept], [s for s in self.answer_starts if s < end], served=list(self.served))

    def arrays(self) -> dict[str, list]:
        """Its per-token values under the keys a recipe's generate node declares (graph/keys.py)."""
        return {"prompt_ids": self.prompt_ids, "output_ids": self.output_ids, "behav_logprobs": self.logprobs,
                "versions": self.versions, "loss_mask": self.loss_mask}
