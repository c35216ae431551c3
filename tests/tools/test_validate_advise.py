"""tools/validate_advise.py's reading of the runs and of the simulations (the runs themselves are
the tool's own: minutes of CPU)."""

import sys
from pathlib import Path

import pytest

from areal_flow.advise.simulate import Candidate, Prediction

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import validate_advise  # noqa: E402


def prediction(rate: float, idle: float, stale_max: int) -> Prediction:
    return Prediction(Candidate(1, 1, eta=4), rate, 40 * rate, idle, 1 - idle, 1.5 * idle, stale_max, 64 / rate,
                      1000.0 * rate, 39)


def test_a_configuration_is_predicted_as_the_mean_of_its_simulations():
    mean = validate_advise.mean_prediction([prediction(100.0, 0.1, 3), prediction(80.0, 0.3, 4)])
    assert mean.samples_per_s == pytest.approx(90.0) and mean.tokens_per_s == pytest.approx(3600.0)
    assert (mean.gen_idle, mean.train_idle, mean.staleness_mean) == pytest.approx((0.2, 0.8, 0.3))
    assert mean.step_s == pytest.approx((0.64 + 0.8) / 2)
    assert mean.staleness_max == 4 and mean.steps == 39 and mean.candidate == Candidate(1, 1, eta=4)


def test_the_measured_figures_leave_the_first_step_out_and_weigh_each_by_its_time():
    rows = [{"event": "start"},
            {"event": "step", "step_seconds": 5.0, "samples_per_second": 1.0, "generator_idle": 0.9,
             "train_seconds": 0.1, "staleness_mean": 0.0},
            {"event": "step", "step_seconds": 1.0, "samples_per_second": 64.0, "generator_idle": 0.1,
             "train_seconds": 0.5, "staleness_mean": 1.0},
            {"event": "step", "step_seconds": 3.0, "samples_per_second": 64 / 3, "generator_idle": 0.3,
             "train_seconds": 1.5, "staleness_mean": 2.0}]
    m = validate_advise.measured(rows)
    assert m["steps"] == 2 and m["samples_per_s"] == pytest.approx(128 / 4)
    assert m["gen_idle"] == pytest.approx((0.1 + 0.9) / 4) and m["train_idle"] == pytest.approx(0.5)
    assert m["staleness_mean"] == pytest.approx(1.5)
