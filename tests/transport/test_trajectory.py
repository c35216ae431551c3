"""The one trajectory type: a one-turn sample, turns with observations between them, a fork's cut,
and the per-token arrays the rollout worker sends."""

from areal_flow.transport.messages import Finish
from areal_flow.transport.trajectory import Trajectory


def test_answers_and_observations_keep_their_masks_logprobs_and_versions():
    t = Trajectory([1, 2])
    t.observe([9], version=7)  # before any answer: the version it is given
    t.answered({"output_ids": [3, 4], "behav_logprobs": [-0.5, -0.25], "versions": [3, 4], "finish": Finish.STOP})
    t.observe([5, 6])  # an observation takes the answer's last version
    t.answer([7], [-1.0], [5])
    assert t.tokens == [1, 2, 9, 3, 4, 5, 6, 7] and t.calls == 2 and t.answer_starts == [3, 7]
    assert t.arrays() == {"prompt_ids": [1, 2], "output_ids": [9, 3, 4, 5, 6, 7], "loss_mask": [0, 1, 1, 0, 0, 1],
                          "behav_logprobs": [0.0, -0.5, -0.25, 0.0, 0.0, -1.0], "versions": [7, 3, 4, 4, 4, 5]}


def test_a_one_turn_sample_keeps_its_finish_and_a_cut_keeps_what_came_before_the_fork():
    t = Trajectory.one_turn([1], {"output_ids": [2, 3], "behav_logprobs": [-1.0, -2.0], "versions": [0, 1],
                                  "finish": Finish.LENGTH})
    assert t.finish == Finish.LENGTH and t.loss_mask == [1, 1] and t.calls == 1
    t.observe([4])
    t.answer([5], [-3.0], [2])
    fork = t.cut(4)  # at the start of the second answer
    assert fork.tokens == [1, 2, 3, 4] and fork.calls == 1 and fork.versions == [0, 1, 1]
    assert t.tokens == [1, 2, 3, 4, 5]  # the original is untouched
