"""tools/bench_peer.py's reading of two learning curves (the runs themselves need the [bench] extra)."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import bench_peer  # noqa: E402


def test_accuracy_at_a_time_is_the_last_checkpoint_before_it_and_reaching_is_the_first_at_or_above():
    points = [(0.0, 0.25), (100.0, 0.50), (200.0, 0.45), (300.0, 0.60)]
    assert bench_peer.accuracy_at(points, 250.0) == 0.45 and bench_peer.accuracy_at(points, 100.0) == 0.50
    assert bench_peer.time_to_reach(points, 0.5) == 100.0 and bench_peer.time_to_reach(points, 0.7) is None
    with pytest.raises(ValueError, match="no checkpoint at or before"):
        bench_peer.accuracy_at([(10.0, 0.3)], 5.0)


def test_the_report_gives_the_ratios_of_the_two_runs():
    peer = bench_peer.Curve("TRL", [], samples=5000, seconds=100.0)
    ours = bench_peer.Curve("areal_flow", [], samples=10000, seconds=100.0)
    points = {"TRL": [(0.0, 0.2), (50.0, 0.4), (100.0, 0.5)],
              "areal_flow": [(0.0, 0.2), (40.0, 0.5), (100.0, 0.6)]}
    args = SimpleNamespace(budget=100.0, eval_n=20, overrides=[])
    text = bench_peer.report(peer, ours, points, 100.0, 0.61, args)
    assert "| trained samples/s | 50.0 | 100.0 | 2.00× |" in text
    assert "| accuracy at 50 s | 40.0% | 50.0% | +10.0 points |" in text
    assert "| accuracy at the end (100 s, 100 s) | 50.0% | 60.0% | +10.0 points |" in text
    assert "| time to 50.0% (the peer's final) | 100 s | 40 s | 0.40 of the peer's time |" in text
    assert "own end-of-run evaluation (its engine, greedy, same file): 61.0%" in text
