"""Dynamic filtering (algorithm.success_rate_range) in a real run: groups outside the range are
dropped, counted and replaced by new ones, every trained group is inside it, and the staleness
bound and the sample accounting still hold."""

import re

import pytest
from run_helpers import ANSWERS_SOME, check_accounting, jsonl, launch, steps_of

pytestmark = pytest.mark.slow


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
