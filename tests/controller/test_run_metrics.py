import time

import numpy as np
import pytest

from areal_flow.controller.run_metrics import RunClock, Traffic, batch_metrics, reward_wait
from areal_flow.transport.messages import Finish, GroupMeta, SampleMeta


def sample(uid: str, answer: int, versions: dict[int, int], scalars: dict[str, float],
           finish: Finish = Finish.STOP) -> SampleMeta:
    return SampleMeta(uid, 0, {"prompt_ids": 3, "output_ids": answer}, versions, scalars, finish)


# ---- RunClock -------------------------------------------------------------------------------

def test_time_spent_paused_is_not_counted_as_training_time():
    clock = RunClock()
    clock.start()
    t0 = time.monotonic()
    with clock.paused():
        time.sleep(0.05)
    wall = time.monotonic() - t0
    elapsed = clock.elapsed()
    assert clock.paused_seconds >= 0.05
    assert 0 <= elapsed < wall - 0.04  # the 50 ms pause is taken out
    assert elapsed == pytest.approx(wall - clock.paused_seconds, abs=0.01)


def test_a_pause_that_raises_is_still_taken_out():
    clock = RunClock()
    clock.start()
    with pytest.raises(RuntimeError):
        with clock.paused():
            time.sleep(0.05)
            raise RuntimeError("evaluation failed")
    assert clock.paused_seconds >= 0.05


def test_start_resets_the_paused_time():
    clock = RunClock(started=time.monotonic() - 100, paused_seconds=40.0)
    clock.start()
    assert clock.paused_seconds == 0.0 and 0 <= clock.elapsed() < 0.05


# ---- Traffic --------------------------------------------------------------------------------

def test_traffic_reports_bytes_sent_per_process_since_the_previous_step():
    t = Traffic()
    t.report("rollout0", 100)
    t.report("trainer0", 50)
    t.report("rollout0", 300)  # running totals: the latest counts
    assert t.step() == {"rollout0": 300, "trainer0": 50}
    t.report("rollout0", 350)
    assert t.step() == {"rollout0": 50, "trainer0": 0}
    t.report("reward0", 70)  # a process first heard of now: its whole total
    assert t.step() == {"reward0": 70, "rollout0": 0, "trainer0": 0}


def test_a_smaller_reported_total_never_makes_a_negative_delta():
    t = Traffic()
    t.report("rollout0", 1000)
    t.step()
    t.report("rollout0", 10)  # an older message arriving late (or a restarted process)
    assert t.step() == {"rollout0": 0}
    t.report("rollout0", 1200)
    assert t.step() == {"rollout0": 200}


def test_a_step_without_reports_is_empty():
    assert Traffic().step() == {}


# ---- batch_metrics --------------------------------------------------------------------------

def test_staleness_is_step_minus_version_weighted_by_tokens():
    groups = [GroupMeta(0, "w", [sample("a", 40, {5: 10, 3: 30}, {"rewards": 1.0}),
                                 sample("b", 20, {4: 20}, {"rewards": 0.0})])]
    m = batch_metrics(groups, step=5, reward_key="rewards", output_key="output_ids")
    assert m["staleness_hist"] == [10, 20, 30]  # 10 tokens of age 0, 20 of age 1, 30 of age 2
    assert m["staleness_mean"] == pytest.approx((0 * 10 + 1 * 20 + 2 * 30) / 60)
    assert m["staleness_max"] == 2


def test_staleness_without_versions_is_zero():
    groups = [GroupMeta(0, "w", [sample("a", 4, {}, {"rewards": 1.0})])]
    m = batch_metrics(groups, step=3, reward_key="rewards", output_key="output_ids")
    assert (m["staleness_hist"], m["staleness_mean"], m["staleness_max"]) == ([0], 0.0, 0)


def test_reward_accuracy_and_other_scalar_keys_are_averaged_over_every_sample():
    groups = [GroupMeta(0, "w", [sample("a", 10, {0: 10}, {"rewards": 1.0, "format": 1.0, "correct": 1.0}),
                                 sample("b", 30, {0: 30}, {"rewards": 0.5, "format": 0.0, "correct": 0.0})]),
              GroupMeta(1, "w", [sample("c", 20, {0: 20}, {"rewards": 2.0, "format": 1.0, "correct": 1.0}),
                                 sample("d", 40, {0: 40}, {"rewards": -1.0, "format": 0.0, "correct": 0.0})])]
    m = batch_metrics(groups, step=0, reward_key="rewards", output_key="output_ids")
    assert m["reward"] == pytest.approx(0.625)
    assert m["accuracy"] == 0.5  # rewards >= 1
    assert m["reward/format"] == 0.5 and m["reward/correct"] == 0.5
    assert "reward/rewards" not in m  # the train reward is `reward`, not repeated
    assert m["response_length"] == 25.0
    assert m["response_length_std"] == pytest.approx(np.std([10, 30, 20, 40]))  # over the batch, not per group
    assert m["response_length_max"] == 40


def test_an_agent_s_drift_rate_is_the_step_s_drifts_per_call_and_dropped_tokens_are_summed():
    scalars = [{"rewards": 1.0, "agent/calls": 1.0, "agent/drifts": 0.0, "agent/drift_rate": 0.0,
                "agent/dropped_tokens": 0.0},
               {"rewards": 0.0, "agent/calls": 4.0, "agent/drifts": 2.0, "agent/drift_rate": 0.5,
                "agent/dropped_tokens": 12.0}]
    m = batch_metrics([GroupMeta(0, "w", [sample(str(i), 5, {0: 5}, s) for i, s in enumerate(scalars)])],
                      step=0, reward_key="rewards", output_key="output_ids")
    assert m["agent/drift_rate"] == pytest.approx(2 / 5)  # not the mean of 0 and 0.5
    assert m["agent/dropped_tokens"] == 12.0 and m["agent/calls"] == 2.5


def test_suspect_is_the_share_of_samples_any_reward_node_flagged():
    groups = [GroupMeta(0, "w", [sample("a", 5, {0: 5}, {"rewards": 1.0, "code_suspect": 1.0, "math_suspect": 0.0}),
                                 sample("b", 5, {0: 5}, {"rewards": 0.0, "code_suspect": 0.0, "math_suspect": 1.0}),
                                 sample("c", 5, {0: 5}, {"rewards": 0.0, "code_suspect": 0.0, "math_suspect": 0.0}),
                                 sample("d", 5, {0: 5}, {"rewards": 0.0})])]  # timed out: no figures
    m = batch_metrics(groups, step=0, reward_key="rewards", output_key="output_ids")
    assert (m["reward/suspect"], m["reward/suspect_samples"]) == (0.5, 2)
    assert m["reward/code_suspect"] == pytest.approx(1 / 3)  # each node's own, over the samples it scored
    plain = [GroupMeta(0, "w", [sample("a", 5, {0: 5}, {"rewards": 1.0, "arith_raw": 1.0})])]
    assert "reward/suspect" not in batch_metrics(plain, step=0, reward_key="rewards", output_key="output_ids")


def test_truncated_fraction_counts_samples_that_did_not_stop():
    finishes = [Finish.STOP, Finish.LENGTH, Finish.ABORT, Finish.STOP]
    groups = [GroupMeta(0, "w", [sample(str(i), 5, {0: 5}, {"rewards": 0.0}, f) for i, f in enumerate(finishes)])]
    m = batch_metrics(groups, step=0, reward_key="rewards", output_key="output_ids")
    assert m["truncated_fraction"] == 0.5


# ---- the trainer's wait on rewards ------------------------------------------------------------

def timed(generated: float, scored: float, **more: float) -> GroupMeta:
    return GroupMeta(0, "w", [], times={"requested": 0.0, "generated": generated, "scored": scored, **more})


def test_the_wait_on_rewards_runs_from_the_last_group_generated_to_the_last_scored():
    # Generated at 10 and 14, scored at 15 and 14.5: without rewards the batch was ready at 14.
    batch = [timed(10.0, 15.0), timed(14.0, 14.5)]
    assert reward_wait(batch, waited_from=0.0) == pytest.approx(1.0)
    # The trainer began to wait later: only what is left of the scoring counts.
    assert reward_wait(batch, waited_from=14.6) == pytest.approx(0.4)
    # Everything scored before the trainer asked: no wait on rewards.
    assert reward_wait(batch, waited_from=20.0) == 0.0
    # A judge's stage belongs to generation: scoring starts after it.
    assert reward_wait([timed(10.0, 13.0, judged=12.5)], waited_from=0.0) == pytest.approx(0.5)
    # Groups without stage times (an old checkpoint's) give no figure rather than a wrong one.
    assert reward_wait([GroupMeta(0, "w", [])], waited_from=0.0) == 0.0
