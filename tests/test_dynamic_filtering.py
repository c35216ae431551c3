"""Dynamic filtering (algorithm.success_rate_range) in a real run: groups outside the range are
dropped, counted and replaced by new ones, every trained group is inside it, and the staleness
bound and the sample accounting still hold."""

import re
import time

import pytest
from run_helpers import ANSWERS_SOME, check_accounting, jsonl, launch, steps_of

pytestmark = pytest.mark.slow

BASE_MODELS = [ANSWERS_SOME]  # bootstrapped ahead by conftest.py


def test_groups_outside_the_success_rate_range_are_dropped_counted_and_replaced(tmp_path, run_cache):
    run_dir = tmp_path / "filtered"
    # The 150-step model answers about a quarter of the problems: most groups of 8 have fewer than
    # 3 right (filtered), some have more (trained).
    r = launch(run_dir, run_cache, *ANSWERS_SOME, "algorithm.success_rate_range=[0.3,1.0]", "rollout.max_staleness=1",
               "eval_at_start=false", "eval_at_end=false", "total_steps=2")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = check_accounting(run_dir, eta=1, group_size=8)  # filtered groups are accounted for too
    assert summary["steps"] == 2 and summary["trained_groups"] == 6
    filtered = [e for e in jsonl(run_dir / "ledger.jsonl") if e["event"] == "filter"]
    assert filtered and summary["filtered_groups"] == len(filtered)
    for e in filtered:
        rate = float(re.fullmatch(r"success rate (\d\.\d\d) outside \[0\.3, 1\]", e["reason"]).group(1))
        assert rate < 0.3
    steps = steps_of(run_dir)
    # Each trained group had at least 3 of 8 right, so every batch is at least 3/8 right.
    assert all(m["accuracy"] >= 3 / 8 for m in steps)
    assert sum(m["filtered_groups"] for m in steps) <= len(filtered)


def test_a_range_that_is_not_low_high_within_0_1_is_refused(tmp_path, run_cache):
    r = launch(tmp_path / "bad", run_cache, "algorithm.success_rate_range=[0.9,0.1]")
    assert r.returncode == 2 and "algorithm.success_rate_range=[0.9, 0.1] must be [low, high]" in r.stdout


def test_a_run_whose_filter_drops_every_group_stops_at_once_naming_the_filter(tmp_path, run_cache):
    # The small model answers almost nothing right (in one run 2 groups of 293 had one answer of
    # 4 right): a range that wants every answer right filters every group. Ten batches' worth in a
    # row (algorithm.filter_stall_batches' default; batches of 2 groups here) end the run, seconds
    # in, not step_timeout's 300 s later.
    run_dir = tmp_path / "starved"
    t0 = time.monotonic()
    r = launch(run_dir, run_cache, "algorithm.success_rate_range=[0.9,1.0]", "eval_at_start=false",
               "eval_at_end=false", "step_timeout=300", "launcher.stop_timeout=2")
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert time.monotonic() - t0 < 150
    out = r.stdout + r.stderr
    assert "the run trains nothing: dynamic filtering dropped the last 20 prompt groups in a row, none kept " \
           "(10 batches' worth, algorithm.filter_stall_batches=10)" in out
    assert "outside algorithm.success_rate_range=[0.9, 1.0]" in out and "widen it, or null to train every group" in out
    reward, correct = re.search(r"mean reward (-?[\d.e-]+), (\d+) of 80 answers correct", out).groups()
    filtered = [e for e in jsonl(run_dir / "ledger.jsonl") if e["event"] == "filter"]
    assert len(filtered) >= 20 and int(correct) < 80 * 0.9  # the ledger holds every one (and any dropped while stopping)
    assert not [e for e in jsonl(run_dir / "ledger.jsonl") if e["event"] == "train"]


def test_without_the_streak_stop_a_starved_run_fails_at_step_timeout_naming_the_filter(tmp_path, run_cache):
    # The first group was filtered 0.5 s in, 400 in 10 s: step_timeout=4 s is ample.
    run_dir = tmp_path / "starved"
    r = launch(run_dir, run_cache, "algorithm.success_rate_range=[0.9,1.0]", "algorithm.filter_stall_batches=0",
               "eval_at_start=false", "eval_at_end=false", "step_timeout=4", "launcher.stop_timeout=2")
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout + r.stderr
    assert "no train step completed within 4 s (step_timeout)" in out
    dropped = int(re.search(r"dynamic filtering dropped (\d+) group\(s\) since the last step", out).group(1))
    assert "outside algorithm.success_rate_range=[0.9, 1.0]" in out
    filtered = [e for e in jsonl(run_dir / "ledger.jsonl") if e["event"] == "filter"]
    assert dropped >= 1 and len(filtered) >= dropped
    assert not [e for e in jsonl(run_dir / "ledger.jsonl") if e["event"] == "train"]
