"""recipes/tiny_arith_judge.yaml end to end: a frozen judge on generation servers of its own, its
answers written beside the policy's and read by a reward node, with real servers and sockets."""

import json

import pytest
import torch
from run_helpers import RECIPE_ETA, TRAIN_EVERY_GROUP, check_accounting, jsonl, launch_recipe, steps_of

from areal_flow.models.bootstrap import ensure_base_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def judge_model(run_cache):
    """A second tiny model (two layers, a short bootstrap), not the policy's start."""
    # Built before the module's one-thread fixture (conftest.py) applies: one thread here too
    # (about 3x faster on this shared 2-core machine than two).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return ensure_base_model(str(run_cache / "models"), arch={"num_hidden_layers": 2}, steps=30, batch_size=32)
    finally:
        torch.set_num_threads(before)


def test_a_judge_answers_every_sample_on_its_own_server_and_is_never_updated(tmp_path, run_cache, judge_model):
    run_dir = tmp_path / "run"
    # SMALL's model answers nothing right: the recipe's filter would drop every group.
    r = launch_recipe(run_dir, run_cache, "tiny_arith_judge", TRAIN_EVERY_GROUP, "launcher.pin_cpus=false", "total_steps=2",
               "eval_at_start=false", f"graph.judge.model={judge_model}")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    check_accounting(run_dir, eta=RECIPE_ETA)
    finished = [e for e in jsonl(run_dir / "ledger.jsonl") if e["event"] == "finish"]
    assert finished and all(e["generated"] <= e["judged"] <= e["scored"] for e in finished)
    for step in steps_of(run_dir):
        assert step["judge/judge_tokens"] > 0 and "reward/judge_reward_raw" in step
        assert "reward/judge_reward_unparsed" in step and "judge/judge_seconds" in step
        # The judge's servers' idle share of the step, as generator_idle (a measured share may dip below 0).
        assert -0.05 <= step["judge_idle/judge"] <= 1.0
    assert steps_of(run_dir)[0]["judge_idle/judge"] < 1.0  # the first step's samples were judged in its window
    assert "weights from" not in (run_dir / "logs" / "judge_server0.log").read_text()  # engine.py logs each load
    assert "weights from" in (run_dir / "logs" / "gen_server0.log").read_text()
    loaded = [e["version"] for e in jsonl(run_dir / "ledger.jsonl") if e["event"] == "loaded"]
    assert loaded == [1, 2]
    assert "judge_server0" in json.loads((run_dir / "processes.json").read_text())
