"""An agent's calls linked into trajectories, token for token: what the gateway records.

Every call an agent makes comes back with its exact prompt and answer tokens (the server's
extension fields). A later call whose prompt starts with a trajectory's tokens (its first prompt,
then each answer and each part the agent added between calls) *extends* it: the new part of the
prompt (tool results, the next user message) joins it as observation tokens (loss mask 0), then the
answer (loss mask 1). A call that starts a trajectory's answer over from the same point (a second
sample of the same turn) *forks* it: a trajectory of its own that shares the tokens up to there.

A call whose prompt follows a trajectory past its first prompt but then differs from what was
recorded, anywhere but at the start of an answer, is a **drift**: the agent re-rendered its
history to other tokens (a template that rewrites earlier turns, text re-tokenized across a seam,
an edited message). The recorded tokens stay as they were (the trajectory ends at its last call),
the call starts a new trajectory whose prompt is what it sent, and the drift is counted with an
example: nothing is ever trained on tokens the policy did not see. Unrelated calls (another
conversation, another agent with the same system prompt) start trajectories of their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from areal_flow.transport.trajectory import Trajectory


@dataclass(frozen=True)
class DriftExample:
    """Where a call's prompt left the recorded tokens: the position and both sides from there."""

    position: int
    recorded: list[int]  # the recorded tokens from `position` (at most 16)
    sent: list[int]  # the call's prompt tokens from `position` (at most 16)


@dataclass
class Recorder:
    """Links one rollout's calls (`record`) into trajectories; counts drifts."""

    trajectories: list[Trajectory] = field(default_factory=list)
    drifts: int = 0
    calls: int = 0
    examples: list[DriftExample] = field(default_factory=list)
    resumes: int = 0  # continuations of answers a weight update cut (the gateway's, agents/resume.py)
    last: Trajectory | None = None  # the trajectory the latest call joined (its final answer's)
    answer_tokens: int = 0  # every call's answer tokens, whichever trajectory they joined

    def record(self, prompt_ids: list[int], output_ids: list[int], logprobs: list[float], versions: list[int]
               ) -> Trajectory:
        """A call's exact tokens joined to the trajectory it extends, forks or starts."""
        if not (len(output_ids) == len(logprobs) == len(versions)):
            raise ValueError(f"a call's answer has {len(output_ids)} tokens, {len(logprobs)} logprobs and "
                             f"{len(versions)} versions")
        self.calls += 1
        self.answer_tokens += len(output_ids)
        prompt = list(prompt_ids)
        best, shared = None, 0  # the trajectory sharing the longest prefix with the prompt
        for trajectory in self.trajectories:
            n = _common_prefix(trajectory.tokens, prompt)
            if n > shared or (n == shared and best is not None and n == len(trajectory.tokens)):
                best, shared = trajectory, n
        if best is not None and shared == len(best.tokens):  # it extends `best`
            _extend(best, prompt[shared:], output_ids, logprobs, versions)
            self.last = best
            return best
        if best is not None and shared in best.answer_starts:  # a fork at the start of an answer
            trajectory = best.cut(shared)
            _extend(trajectory, prompt[shared:], output_ids, logprobs, versions)
        else:
            if best is not None and best.calls and shared > len(best.prompt_ids):
                self.drifts += 1
                self.examples.append(DriftExample(shared, best.tokens[shared: shared + 16], prompt[shared: shared + 16]))
            trajectory = Trajectory(prompt)
            _extend(trajectory, [], output_ids, logprobs, versions)
        self.trajectories.append(trajectory)
        self.last = trajectory
        return trajectory

    @property
    def drift_rate(self) -> float:
        """Drifts per call (`agent/drift_rate`)."""
        return self.drifts / self.calls if self.calls else 0.0

    def dropped_tokens(self, trained: Trajectory) -> int:
        """The policy's tokens the rollout generated that `trained` (its sample) does not hold: the
        answers of its other trajectories (a drift's earlier segments, a fork), `agent/dropped_tokens`."""
        return self.answer_tokens - sum(trained.loss_mask)


def _extend(trajectory: Trajectory, observation: list[int], output_ids: list[int], logprobs: list[float],
            versions: list[int]) -> None:
    """A call joins `trajectory`: the new part of its prompt (what the agent added) as an
    observation, of its answer's version where the trajectory has none yet, then its answer."""
    trajectory.observe(observation, versions[0] if versions else 0)
    trajectory.answer(list(output_ids), list(logprobs), list(versions))


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)
