"""The step profile: phase timers, the table's shares, and the timeline plot."""

import time

import pytest

from areal_flow.metrics.profile import Phases, plot_timeline, profile_rows, profile_table


def test_phases_sum_each_named_block_and_reset():
    phases = Phases()
    for _ in range(2):
        with phases("a"):
            time.sleep(0.01)
    with pytest.raises(ValueError), phases("b"):  # a failing block still counts its time
        raise ValueError
    got = phases.reset()
    assert set(got) == {"a_seconds", "b_seconds"} and 0.02 <= got["a_seconds"] < 0.2
    assert phases.reset() == {}


def step(elapsed, **overrides):
    row = {"event": "step", "elapsed": elapsed, "step_seconds": 1.0, "train_seconds": 0.6, "update_seconds": 0.1,
           "generator_idle": 0.3, "train/forward_seconds": 0.2, "train/backward_seconds": 0.25,
           "train/optimizer_seconds": 0.05}
    return {**row, **overrides}


def test_rows_give_each_phase_its_share_and_the_rest_to_other_and_idle():
    metrics = [step(5.0, step_seconds=5.0, train_seconds=4.0), step(6.0), step(7.0)]  # the first is left out
    rows = {(role, phase): (sec, share) for role, phase, sec, share in profile_rows(metrics)}
    assert rows[("trainer", "forward")] == pytest.approx((0.2, 0.2))
    assert rows[("trainer", "other")] == pytest.approx((0.6 - 0.5, 0.1))
    assert rows[("trainer", "idle")] == pytest.approx((0.4, 0.4))
    assert rows[("generator", "generate")] == pytest.approx((0.7, 0.7))
    assert rows[("generator", "load weights")] == pytest.approx((0.1, 0.1))
    assert rows[("generator", "idle")] == pytest.approx((0.2, 0.2))
    assert ("trainer", "prox") not in rows  # a phase no step reported is not a row


def test_the_servers_compute_counts_split_generating_into_decode_and_prefill():
    metrics = [step(float(t), **{"gen/decode_seconds": 0.55, "gen/prefill_seconds": 0.1}) for t in range(1, 4)]
    rows = {(role, phase): (sec, share) for role, phase, sec, share in profile_rows(metrics)}
    assert rows[("generator", "prefill")] == pytest.approx((0.1, 0.1))
    assert rows[("generator", "decode")] == pytest.approx((0.6, 0.6))  # the busy time less the prefills
    assert ("generator", "generate") not in rows


def test_the_table_and_the_timeline_are_written(tmp_path):
    metrics = [step(float(t)) for t in range(1, 6)]
    table = profile_table(metrics)
    assert "| trainer | backward | 0.2500 | 25.0% |" in table and "Mean over 4 steps" in table
    assert profile_table([]) == "no steps to profile\n"
    path = plot_timeline(metrics, str(tmp_path / "t.png"))
    assert (tmp_path / "t.png").stat().st_size > 1000 and path.endswith("t.png")


@pytest.mark.parametrize("idle", [-0.02, 1.3, float("nan")])
def test_the_timeline_draws_an_idle_share_outside_zero_to_one(tmp_path, idle):
    # A measured generator_idle of -0.02 made the shade's alpha 1.02, which matplotlib refused: a
    # finished run exited 1 while writing profile.png.
    metrics = [step(float(t), generator_idle=idle) for t in range(1, 6)]
    path = plot_timeline(metrics, str(tmp_path / "t.png"))
    assert (tmp_path / "t.png").stat().st_size > 1000 and path.endswith("t.png")
