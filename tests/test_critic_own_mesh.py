"""recipes/tiny_arith_ppo.yaml with the critic on a mesh of its own, end to end: two processes on
cores 2 and 3 compute the values of the groups routed to each and train the critic together (data
parallel) on each step's batch, while the trainer rank trains the actor; the checkpoint holds the
critic, and a resumed run goes on from it."""

import json
import re

import pytest
from run_helpers import ANSWERS_SOME, check_accounting, jsonl, launch_recipe, steps_of

pytestmark = pytest.mark.slow

BASE_MODELS = [ANSWERS_SOME]  # bootstrapped ahead by conftest.py

APART = (*ANSWERS_SOME, "cluster.n_devices=4", "graph.critic_values.mesh=2-3",
         "graph.critic_train.mesh=2-3", "launcher.pin_cpus=false", "eval_at_start=false", "eval_at_end=false")
CRITICS = ("critic_values_infer0", "critic_values_infer1")


def test_the_critic_trains_on_its_own_mesh_is_checkpointed_and_resumes(tmp_path, run_cache):
    run_dir = tmp_path / "run"
    r = launch_recipe(run_dir, run_cache, "tiny_arith_ppo", *APART, "total_steps=3")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    check_accounting(run_dir, eta=1, group_size=8)
    # The trainer rank ran the actor's node only; each of the critic's processes valued the trained
    # groups routed to it (group id mod 2), once ...
    trained = jsonl(run_dir / "trained-rank0.jsonl")
    assert [row["nodes"] for row in trained] == [["actor_train"]] * 3
    groups = {int(uid.split("-")[0][1:]) for row in trained for uid in row["uids"]}
    logs = [(run_dir / "logs" / f"{name}.log").read_text() for name in CRITICS]
    for replica, log in enumerate(logs):
        valued = [int(g) for groups in re.findall(r"values of groups \[([\d, ]*)\]", log) for g in groups.split(", ")
                  if g]
        assert {g for g in groups if g % 2 == replica} <= set(valued) and all(g % 2 == replica for g in valued)
        assert len(valued) == len(set(valued)), valued
    # ... and both trained the critic once a step, together on every trained sample (3 groups of 8).
    per_step = [re.findall(r"trained the critic on step (\d+) \((\d+) sequences", log) for log in logs]
    assert [s for s, _ in per_step[0]] == [s for s, _ in per_step[1]] == ["1", "2", "3"]
    assert [int(a) + int(b) for (_, a), (_, b) in zip(*per_step)] == [24, 24, 24]
    steps = steps_of(run_dir)
    assert steps[0]["train/critic/value_sum"] == 0.0 and steps[-1]["train/critic/value_sum"] != 0.0
    assert all(m["train/critic/n_valid_tokens"] == m["train/n_valid_tokens"] > 0 for m in steps)
    assert all(m["train/infer/critic_values_seconds"] > 0 for m in steps)
    config = json.loads((run_dir / "checkpoint" / "critic" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForTokenClassification"]
    assert (run_dir / "checkpoints" / "step-00000003" / "critic").is_dir()

    r = launch_recipe(run_dir, run_cache, "tiny_arith_ppo", *APART, "total_steps=4", "resume=auto")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for name in CRITICS:
        log = (run_dir / "logs" / f"{name}.log").read_text()
        assert "the critic resumed from " in log and "step-00000003 at version 3" in log
        assert "trained the critic on step 4 " in log
    check_accounting(run_dir, eta=1, group_size=8)
