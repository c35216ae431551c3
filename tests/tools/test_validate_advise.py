"""tools/validate_advise.py's reading of the measured runs (the runs themselves are the tool's own:
minutes of CPU)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import validate_advise  # noqa: E402


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
