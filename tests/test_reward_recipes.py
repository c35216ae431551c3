"""The CPU smoke recipes of the math and code paths run end to end: the sample sets, the math and
code rewards in their worker pools (the code one in the sandbox), shaped rewards and the reward
metrics reach the trainer and metrics.jsonl."""

import json
import os
from pathlib import Path

import pytest
from run_helpers import RECIPE_ETA, TRAIN_EVERY_GROUP, check_accounting, jsonl, launch_recipe, steps_of

from areal_flow.models.tokenizer import load_tokenizer
from areal_flow.rewards.code import TEST_STATUSES

pytestmark = pytest.mark.slow


@pytest.mark.skipif(os.geteuid() != 0, reason="the code sandbox's namespaces need root, as on CI")
def test_code_tiny_runs_every_completion_in_the_sandbox(tmp_path, run_cache):
    run_dir = tmp_path / "code_tiny"
    # A 5-step bootstrap writes nothing that passes, so the filter would drop every group: trained here.
    r = launch_recipe(run_dir, run_cache, "code_tiny", "eval_at_start=false", "total_steps=2", TRAIN_EVERY_GROUP,
                      "algorithm.n_minibatches=2", "model.bootstrap_steps=5")  # SMALL has 2 groups a step
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "reward node reward: local sandbox (pid_namespace, network_namespace, mount_namespace" in r.stdout
    check_accounting(run_dir, eta=4)  # code_7b's η
    # The code model: its own characters (printable ASCII) and chat template, bootstrapped on tiny_code.
    model_dir = Path(json.loads((run_dir / "spec.json").read_text())["model_path"])
    assert json.loads((model_dir / "bootstrap.json").read_text())["settings"]["task"] == "tiny_code"
    assert len(load_tokenizer(str(model_dir))) == 101
    for m in steps_of(run_dir):
        # AReaL's ±5: a program passes every hidden test (+5) or not (-5).
        assert -5.0 <= m["reward"] <= 5.0 and m["reward"] == pytest.approx(10 * (m["reward/reward_raw"] - 0.5))
        assert m["reward/reward_error"] == 0.0 and m["reward/reward_timeout"] == 0.0
        # The programs ran (no sandbox errors); every status has its share.
        shares = {k.removeprefix("reward/reward_tests_"): v for k, v in m.items() if k.startswith("reward/reward_tests_")}
        assert set(shares) == set(TEST_STATUSES) and sum(shares.values()) == pytest.approx(1.0)
        assert shares["sandbox_error"] == 0.0 and shares["no_code"] < 1.0
        assert m["reward/reward_seconds"] > 0
        assert 0 < m["reward_busy/reward"] and 0 <= m["trainer_reward_wait"] < 1
    held_out = [m for m in jsonl(run_dir / "metrics.jsonl") if m["event"] == "eval"]
    assert held_out and all(0.0 <= m["accuracy"] <= 1.0 for m in held_out)


def test_math_tiny_scores_with_math_verify_in_worker_processes(tmp_path, run_cache):
    run_dir = tmp_path / "math_tiny"
    r = launch_recipe(run_dir, run_cache, "math_tiny", "eval_at_start=false", "eval_at_end=false", "total_steps=2")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    check_accounting(run_dir, eta=RECIPE_ETA)
    for m in steps_of(run_dir):
        assert m["reward"] == -5.0 and m["reward/reward_error"] == 0.0 and m["reward/reward_timeout"] == 0.0
        assert 0 < m["reward_busy/reward"] < 1


MULTI_TURN = ("graph.generate.outputs=[prompt_ids,output_ids,behav_logprobs,versions,loss_mask]",
              "graph.actor_train.inputs=[prompt_ids,output_ids,behav_logprobs,versions,prox_logprobs,rewards,loss_mask]")


def test_a_multi_turn_run_trains_trajectories_with_observations_between_their_turns(tmp_path, run_cache):
    run_dir = tmp_path / "nudged"
    r = launch_recipe(run_dir, run_cache, "code_tiny", "eval_at_start=false", "eval_at_end=false", "total_steps=2",
                      TRAIN_EVERY_GROUP, "algorithm.n_minibatches=2", "model.bootstrap_steps=5", *MULTI_TURN,
                      "+graph.generate.env=nudge_env:Nudge", "graph.generate.max_turns=2", "dump.every_steps=1",
                      env={"PYTHONPATH": str(Path(__file__).parent / "envs")})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "generate node generate: environment nudge_env:Nudge, up to 2 turns" in r.stdout
    check_accounting(run_dir, eta=4)  # every group trained once, realised staleness within η
    for m in steps_of(run_dir):
        ends = {k: v for k, v in m.items() if k.startswith("env/end_")}
        assert sum(ends.values()) == pytest.approx(1.0)
        # The nudge is never done: a trajectory ends at its second turn, or at a turn cut at the
        # answer budget. The nudge's tokens are observations: in the answer, out of the loss.
        assert ends["env/end_max_turns"] + ends["env/end_turn_length"] == pytest.approx(1.0)
        assert 1 + ends["env/end_max_turns"] <= m["env/turns"] <= 2
        if m["env/turns"] > 1:
            assert m["env/nudges"] > 0 and m["env/observation_tokens"] > 0
            assert m["train/n_valid_tokens"] < m["response_length"] * 8  # 8 answers a step
    # The sample dumps show each trajectory's turns and the nudge between them, marked.
    dumped = [r for f in sorted((run_dir / "dumps").glob("step-*.jsonl")) for r in jsonl(f)]
    assert dumped and all("".join(p["text"] for p in r["turns"]) == r["answer"] for r in dumped)
    nudged = [r for r in dumped if len(r["turns"]) > 1]
    assert nudged and all(r["turns"][1] == {"by": "env", "tokens": 9, "text": "\n# again\n"} for r in nudged)
