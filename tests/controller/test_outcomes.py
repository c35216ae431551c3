"""What becomes of a scored group: routed, filtered or dropped, each in the ledger, and the stop of a
run whose groups are all filtered (controller/outcomes.py)."""

import json

from areal_flow.controller.intake import Intake
from areal_flow.controller.ledger import Ledger
from areal_flow.controller.outcomes import Outcomes, token_versions
from areal_flow.controller.rollout_failures import FailedGroups, RolloutFailures
from areal_flow.controller.staleness import StalenessManager
from areal_flow.controller.state import RunState
from areal_flow.transport.messages import DROP, Finish, GroupMeta, SampleMeta

KEYS = ["prompt_ids", "output_ids"]


def meta(gid: int, rewards: list[float], versions=None) -> GroupMeta:
    return GroupMeta(gid, "reward0", [SampleMeta(f"g{gid}-{i}", i, {"prompt_ids": 3, "output_ids": 5},
                                                 versions or {0: 5}, {"rewards": r}, Finish.STOP)
                                      for i, r in enumerate(rewards)], times={"scored": 1.5})


def outcomes(tmp_path, bounds=None, stall_batches=0, running=(1, 2, 3, 4)) -> tuple[Outcomes, Ledger]:
    state = RunState(StalenessManager(2, 1, 100), Intake(2, 2, KEYS, ["output_ids"], "prompt_ids", "rewards"))
    for g in running:
        state.staleness.admit(g)
    ledger = Ledger(str(tmp_path / "ledger.jsonl"))
    return Outcomes(state, ledger, RolloutFailures(FailedGroups(0)), success_rate_range=bounds,
                    filter_stall_batches=stall_batches, batch_size=2), ledger


def events(tmp_path, ledger) -> list[dict]:
    ledger.flush()
    return [json.loads(line) for line in (tmp_path / "ledger.jsonl").read_text().splitlines()]


def test_a_trainable_group_goes_to_the_least_loaded_rank_and_finishes(tmp_path):
    out, ledger = outcomes(tmp_path)
    assert out.decide(meta(1, [1.0, 0.0], {2: 3, 3: 2})) == 0
    assert out.decide(meta(2, [1.0, 0.0])) == 1
    state = out.state
    assert set(state.staleness.finished) == {1, 2} and state.generated_tokens == 20
    first = events(tmp_path, ledger)[0]
    assert (first["event"], first["group"], first["rank"], first["tokens"], first["lengths"], first["scored"]) == \
        ("finish", 1, 0, {"2": 6, "3": 4}, [5, 5], 1.5)


def test_a_group_outside_the_success_range_is_filtered_and_opens_admission(tmp_path):
    out, ledger = outcomes(tmp_path, bounds=[0.1, 0.9])
    assert out.decide(meta(1, [1.0, 1.0])) == DROP  # all right: nothing to learn
    state = out.state
    assert 1 not in state.staleness.running and 1 not in state.staleness.finished and len(state.intake) == 0
    assert state.filtered == 1 and state.generated_tokens == 10
    (e,) = events(tmp_path, ledger)
    assert (e["event"], e["reason"]) == ("filter", "success rate 1.00 outside [0.1, 0.9]")


def test_an_unusable_group_is_dropped_and_accounted_for(tmp_path):
    out, ledger = outcomes(tmp_path)
    assert out.decide(meta(1, [1.0])) == DROP  # one sample of two
    assert 1 not in out.state.staleness.running and out.state.intake.dropped == 1 and out.state.filtered == 0
    (e,) = events(tmp_path, ledger)
    assert (e["event"], e["reason"]) == ("drop", "1 samples, want 2")


def test_a_run_whose_every_group_is_filtered_stops_after_its_limit_in_a_row(tmp_path):
    out, _ = outcomes(tmp_path, bounds=[0.1, 0.9], stall_batches=1)  # 1 batch of 2 groups
    out.decide(meta(1, [0.0, 0.0]))
    assert out.filter_stalled() is None
    out.decide(meta(2, [1.0, 0.0]))  # kept: the streak starts again
    out.decide(meta(3, [0.0, 0.0]))
    assert out.filter_stalled() is None
    out.decide(meta(4, [0.0, 0.0]))
    assert out.filter_stalled() == (
        "the run trains nothing: dynamic filtering dropped the last 2 prompt groups in a row, none kept (1 batches' "
        "worth, algorithm.filter_stall_batches=1); their success rates fell outside "
        "algorithm.success_rate_range=[0.1, 0.9] (mean reward 0, 0 of 4 answers correct (reward >= 1)): widen it, "
        "or null to train every group")


def test_token_versions_count_each_versions_answer_tokens():
    assert token_versions(GroupMeta(0, "w", [])) == {}
    assert token_versions(meta(0, [1.0, 0.0], {4: 2, 5: 3})) == {"4": 4, "5": 6}
