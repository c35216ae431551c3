"""tools/bench_async.py's pipeline bound: the most overlapping generation and training can gain
over taking turns, from the η = 0 runs' busy seconds a step."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from bench_async import pipeline_bound  # noqa: E402


def test_balanced_sides_bound_at_two_and_an_unbalanced_pipeline_at_less():
    assert pipeline_bound([{"gen_seconds": 1.0, "train_seconds": 1.0}]) == (1.0, 1.0, 2.0)
    t_gen, t_train, bound = pipeline_bound([{"gen_seconds": 3.0, "train_seconds": 1.0},
                                            {"gen_seconds": 1.0, "train_seconds": 1.0}])  # means: 2.0 and 1.0
    assert (t_gen, t_train) == (2.0, 1.0) and bound == pytest.approx(1.5)
