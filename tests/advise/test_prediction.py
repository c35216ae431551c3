"""What a simulation predicts from what it recorded: only the measured window's steps count, and
several simulations of one candidate average into one prediction."""

import pytest

from areal_flow.advise.prediction import Candidate, Measured, mean_prediction

CAND = Candidate(gen_devices=2, train_devices=1, eta=1)


def _measured() -> Measured:
    """Three steps ending at 10, 20 and 40 s: the first is the warm-up."""
    return Measured(step_ends=[10.0, 20.0, 40.0], train_spans=[(0.0, 8.0), (12.0, 18.0), (25.0, 35.0)],
                    step_tokens=[100, 200, 300, 999],  # the fourth: a step begun after the last one ended
                    hist=[{0: 100}, {0: 150, 1: 50}, {2: 300}],
                    busy_marks=[(6.0, 1000), (24.0, 4600)])


def test_only_the_steps_after_the_warm_up_count():
    p = _measured().prediction(CAND, warmup=1, total=3, gen_devices=2, answers_per_step=4)
    assert p.steps == 2 and p.step_s == pytest.approx(15.0)  # 30 s for steps 2 and 3
    assert p.samples_per_s == pytest.approx(2 * 4 / 30) and p.tokens_per_s == pytest.approx(500 / 30)
    assert p.train_idle == pytest.approx(1 - (6 + 10) / 30)  # the first step's training is before the window
    assert p.gen_idle == pytest.approx(1 - 18 / 30)
    assert p.gen_tokens_per_busy_s == pytest.approx(3600 / (18 * 2))
    assert p.staleness_mean == pytest.approx((50 * 1 + 300 * 2) / 500)
    assert p.staleness_max == 2


def test_without_a_warm_up_the_window_starts_at_zero():
    measured = _measured()
    measured.busy_marks = [(24.0, 4600)]
    p = measured.prediction(CAND, warmup=0, total=3, gen_devices=2, answers_per_step=4)
    assert p.steps == 3 and p.step_s == pytest.approx(40 / 3) and p.gen_idle == pytest.approx(1 - 24 / 40)


def test_several_simulations_average_and_keep_the_largest_staleness():
    one = _measured().prediction(CAND, warmup=1, total=3, gen_devices=2, answers_per_step=4)
    other = _measured().prediction(CAND, warmup=0, total=3, gen_devices=2, answers_per_step=4)
    mean = mean_prediction([one, other])
    assert mean.step_s == pytest.approx((15.0 + 40 / 3) / 2)
    assert mean.staleness_max == 2 and mean.steps == one.steps and mean.candidate == CAND
    assert mean_prediction([one]) is one
