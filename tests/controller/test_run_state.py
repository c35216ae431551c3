"""The controller's run state survives a save and a load as it was, and a resumed stream of
prompts goes on where it stopped."""

import pytest

from areal_flow.controller import state as run_state
from areal_flow.controller.intake import Intake
from areal_flow.controller.prompts import PromptStream
from areal_flow.controller.staleness import StalenessManager
from areal_flow.transport.messages import Finish, GroupMeta, SampleMeta


def group(gid: int) -> GroupMeta:
    samples = [SampleMeta(f"g{gid}-{i}", i, {"prompt_ids": 3, "output_ids": 4, "versions": 4}, {0: 4},
                          {"rewards": float(i)}, Finish.STOP) for i in range(2)]
    return GroupMeta(gid, "reward0", samples, times={"scored": 1.5})


def make_state(n_ranks: int = 2) -> run_state.RunState:
    staleness = StalenessManager(batch_size=2, max_staleness=1, max_concurrent=8)
    intake = Intake(2, n_ranks, token_keys=["prompt_ids", "output_ids", "versions"],
                    output_keys=["output_ids", "versions"], prompt_key="prompt_ids", reward_key="rewards")
    state = run_state.RunState(staleness=staleness, intake=intake)
    for gid in range(4):
        staleness.admit(gid)
        state.running_prompts[gid] = 10 + gid
    state.next_group = 4
    for gid in (0, 1, 2):
        staleness.finish(gid)
        assert intake.accept(group(gid))[1] is None
        del state.running_prompts[gid]
    staleness.trained([0])
    intake.take([0])
    state.step, state.filtered, state.trainer_seconds = 1, 2, 3.5
    return state


def test_a_saved_state_loads_as_it_was(tmp_path):
    state = make_state()
    run_state.save(state, str(tmp_path))
    back = run_state.load(str(tmp_path))
    assert back == state
    assert back.intake.groups[1].samples[0].lengths == {"prompt_ids": 3, "output_ids": 4, "versions": 4}
    assert back.staleness.running == {3: 0} and back.running_prompts == {3: 13}
    assert back.trained_groups() == 4 - 1 - 2 - 0 - 2  # admitted - running - buffered - dropped - filtered
    assert back.intake.tokens(1) == state.intake.tokens(1)


def test_fewer_ranks_hold_the_groups_of_those_that_are_gone():
    state = make_state(n_ranks=2)
    assert set(state.intake.location.values()) == {0, 1}
    run_state.for_ranks(state, 1)
    assert set(state.intake.location.values()) == {0} and state.intake.load() == [sum(state.intake.load())]


@pytest.mark.parametrize("cut", [0, 3, 7, 12])
def test_a_prompt_stream_resumes_where_it_was(cut):
    rows = [{"id": str(i)} for i in range(5)]
    whole = PromptStream(rows, seed=3)
    order = [whole.next_index() for _ in range(12)]  # past the first epoch's end
    first = PromptStream(rows, seed=3)
    for _ in range(cut):
        first.next_index()
    resumed = PromptStream(rows, seed=3)
    resumed.seek(first.epoch, first.cursor)
    assert [resumed.next_index() for _ in range(12 - cut)] == order[cut:]
