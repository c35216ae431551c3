"""Linking an agent's calls into trajectories (agents/trajectories.py): extension, forks, unrelated
calls and drift, with nothing trained on tokens the policy did not write or see."""

from __future__ import annotations

import pytest

from areal_flow.agents.trajectories import Recorder

SYSTEM = [1, 2, 3, 4]


def answer(tokens: list[int], version: int = 5) -> tuple[list[int], list[float], list[int]]:
    return tokens, [-(i + 1) / 4 for i in range(len(tokens))], [version] * len(tokens)


def test_calls_that_extend_each_other_make_one_trajectory_with_observations_masked():
    recorder = Recorder()
    first = SYSTEM + [10, 11]
    recorder.record(first, *answer([20, 21, 22]))
    second = first + [20, 21, 22] + [30, 31]  # the tool's result added by the agent
    recorder.record(second, *answer([40, 41], version=6))
    (trajectory,) = recorder.trajectories
    assert trajectory.prompt_ids == first and trajectory.calls == 2
    assert trajectory.tokens == second + [40, 41]
    assert trajectory.loss_mask == [1, 1, 1, 0, 0, 1, 1]
    assert trajectory.logprobs == [-0.25, -0.5, -0.75, 0.0, 0.0, -0.25, -0.5]
    assert trajectory.versions == [5, 5, 5, 5, 5, 6, 6]  # an observation takes the version of the answer before it
    assert recorder.drifts == 0 and recorder.drift_rate == 0.0


def test_an_edited_earlier_message_is_a_drift_and_starts_a_new_trajectory():
    recorder = Recorder()
    first = SYSTEM + [10, 11]
    recorder.record(first, *answer([20, 21, 22]))
    edited = first + [20, 99, 22] + [30]  # the agent re-rendered its own answer to other tokens
    recorder.record(edited, *answer([40]))
    old, new = recorder.trajectories
    assert old.tokens == first + [20, 21, 22] and old.calls == 1  # the recorded tokens stay as they were
    assert new.prompt_ids == edited and new.loss_mask == [1]  # the drifted history is prompt: never trained
    assert recorder.drifts == 1 and recorder.drift_rate == 0.5
    (example,) = recorder.examples
    assert example.position == len(first) + 1 and example.recorded[0] == 21 and example.sent[0] == 99
    assert recorder.dropped_tokens(new) == 3  # the first segment's answer is not in the trained trajectory


def test_a_second_sample_of_the_same_turn_forks_and_unrelated_calls_start_their_own():
    recorder = Recorder()
    first = SYSTEM + [10, 11]
    recorder.record(first, *answer([20, 21]))
    recorder.record(first + [20, 21, 30], *answer([40]))
    recorder.record(first, *answer([22, 23]))  # the same prompt again: another sample of turn 1
    recorder.record(first + [20, 21, 30], *answer([41]))  # a second sample of turn 2: a fork at its answer
    recorder.record(SYSTEM + [12, 13], *answer([50]))  # another conversation with the same system prompt
    assert recorder.drifts == 0 and len(recorder.trajectories) == 4
    assert [t.tokens for t in recorder.trajectories[1:]] == [
        first + [22, 23], first + [20, 21, 30, 41], SYSTEM + [12, 13, 50]]
    fork = recorder.trajectories[2]
    assert fork.loss_mask == [1, 1, 0, 1] and fork.calls == 2
    # Trained, the fork holds turn 1's first answer and its own: the other answers (4 tokens) are dropped.
    assert recorder.answer_tokens == 7 and recorder.dropped_tokens(fork) == 4


def test_a_call_whose_answer_and_logprobs_disagree_is_refused():
    with pytest.raises(ValueError, match="2 tokens, 1 logprobs and 2 versions"):
        Recorder().record(SYSTEM, [1, 2], [-0.1], [0, 0])
