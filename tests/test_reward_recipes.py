"""The CPU smoke recipes of the math and code paths run end to end: the sample sets, the math and
code rewards in their worker pools (the code one in the sandbox), shaped rewards and the reward
metrics reach the trainer and metrics.jsonl."""

import os

import pytest
from run_helpers import RECIPE_ETA, check_accounting, launch_recipe, steps_of

from areal_flow.rewards.code import TEST_STATUSES

pytestmark = pytest.mark.slow


@pytest.mark.skipif(os.geteuid() != 0, reason="the code sandbox's namespaces need root, as on CI")
def test_code_tiny_runs_every_completion_in_the_sandbox(tmp_path, run_cache):
    run_dir = tmp_path / "code_tiny"
    r = launch_recipe(run_dir, run_cache, "code_tiny", "eval_at_start=false", "total_steps=2")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "reward node reward: local sandbox (pid_namespace, network_namespace, mount_namespace" in r.stdout
    check_accounting(run_dir, eta=RECIPE_ETA)
    for m in steps_of(run_dir):
        # The tiny model writes no Python: every program fails, shaped to -5 (AReaL's ±5).
        assert m["reward"] == -5.0 and m["reward/reward_raw"] == 0.0
        assert m["reward/reward_error"] == 0.0 and m["reward/reward_timeout"] == 0.0
        # The programs ran (no sandbox errors) and failed their tests; every status has its share.
        shares = {k.removeprefix("reward/reward_tests_"): v for k, v in m.items() if k.startswith("reward/reward_tests_")}
        assert set(shares) == set(TEST_STATUSES) and sum(shares.values()) == pytest.approx(1.0)
        assert shares["sandbox_error"] == shares["passed"] == 0.0 and shares["runtime_error"] > 0
        assert m["reward/reward_seconds"] > 0
        assert 0 < m["reward_busy/reward"]


def test_math_tiny_scores_with_math_verify_in_worker_processes(tmp_path, run_cache):
    run_dir = tmp_path / "math_tiny"
    r = launch_recipe(run_dir, run_cache, "math_tiny", "eval_at_start=false", "eval_at_end=false", "total_steps=2")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    check_accounting(run_dir, eta=RECIPE_ETA)
    for m in steps_of(run_dir):
        assert m["reward"] == -5.0 and m["reward/reward_error"] == 0.0 and m["reward/reward_timeout"] == 0.0
        assert 0 < m["reward_busy/reward"] < 1
