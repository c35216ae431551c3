"""tools/bench_recipes.py's figures of a run: trained samples/s over the timed steps (the first, with
start-up, left out), each side's busy share, the generator's decode and prefill seconds a step."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from bench_recipes import measure  # noqa: E402


def step(seconds: float, rate: float, idle: float, train: float, wait: float = 0.0, decode: float = 0.0) -> dict:
    return {"event": "step", "step_seconds": seconds, "samples_per_second": rate, "generator_idle": idle,
            "train_seconds": train, "train/wait_seconds": wait, "gen/decode_seconds": decode,
            "gen/prefill_seconds": 0.5}


def test_the_first_step_is_left_out_and_rates_are_weighted_by_time():
    metrics = [step(100.0, 1.0, 1.0, 0.0), {"event": "eval"}, step(1.0, 64.0, 0.1, 0.5, decode=0.8),
               step(3.0, 32.0, 0.5, 2.5, wait=1.0, decode=1.2)]
    figures = measure(metrics)
    assert figures["samples_per_s"] == pytest.approx((64.0 + 96.0) / 4.0)
    assert figures["generator_busy"] == pytest.approx(1 - (0.1 + 1.5) / 4.0)
    assert figures["trainer_busy"] == pytest.approx((0.5 + 1.5) / 4.0)  # its wait for groups is not work
    assert (figures["decode_s"], figures["prefill_s"]) == (pytest.approx(1.0), pytest.approx(0.5))
