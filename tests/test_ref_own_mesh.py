"""recipes/tiny_arith_ref.yaml end to end: the ref model on a mesh of its own, in an inference
process of its own, its ref_logprobs joined to the groups on the trainer rank by group id."""

import re
from collections import Counter

import pytest
from run_helpers import RECIPE_ETA, TRAIN_EVERY_GROUP, check_accounting, jsonl, launch_recipe, steps_of

pytestmark = pytest.mark.slow


def test_the_ref_model_runs_on_its_own_mesh_and_its_logprobs_reach_the_trained_groups(tmp_path, run_cache):
    run_dir = tmp_path / "run"
    # Three devices on two cores: the processes float. SMALL's model answers nothing right: the
    # recipe's filter would drop every group. The KL settings are the on-trainer variant's
    # (tests/test_recipe_variants.py), so are the KL statistics it checks.
    r = launch_recipe(run_dir, run_cache, "tiny_arith_ref", TRAIN_EVERY_GROUP, "launcher.pin_cpus=false", "total_steps=2",
               "eval_at_start=false", "eval_at_end=false", "algorithm.kl_coef=0.05", "algorithm.kl_target=1.0",
               "algorithm.kl_horizon=8")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    check_accounting(run_dir, eta=RECIPE_ETA)
    # The trainer ran no ref node (and no prox node: one optimizer step per update) ...
    trained = jsonl(run_dir / "trained-rank0.jsonl")
    assert [row["nodes"] for row in trained] == [["actor_train"]] * 2
    # ... the inference process computed the ref_logprobs of every trained group, once.
    log = (run_dir / "logs" / "ref_infer0.log").read_text()
    served = Counter(int(g) for groups in re.findall(r"ref_logprobs of groups \[([\d, ]*)\]", log)
                     for g in groups.split(", ") if g)
    groups = {int(uid.split("-")[0][1:]) for row in trained for uid in row["uids"]}
    assert groups and all(served[g] == 1 for g in groups), (groups, served)
    steps = steps_of(run_dir)
    kl = [m["train/kl_sum"] for m in steps]
    # Step 1 trains the start weights, which the ref model also holds: KL 0; k3 is never < 0.
    assert kl[0] == pytest.approx(0.0, abs=1e-6) and min(kl) >= 0
    assert all(m["train/kl_mean"] < 0.8 for m in steps)
    assert [m["train/kl_coef"] for m in steps] == pytest.approx([0.05, 0.04])
    assert all(m["train/infer/ref_seconds"] > 0 for m in steps)


def test_a_killed_inference_process_is_restarted_alone_and_the_run_goes_on(tmp_path, run_cache):
    import os
    import signal

    from run_helpers import run_processes
    from test_resume_end_to_end import start, wait_for_step

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    # Steps enough after the kill that the run still needs ref logprobs then: with 5 it once ended
    # on groups whose ref logprobs were computed ahead, before the launcher saw the death.
    proc = start(run_dir, run_cache, "recipe=tiny_arith_ref", "launcher.pin_cpus=false", "total_steps=10",
                 "recover.infer_rerequest_seconds=2")
    try:
        wait_for_step(run_dir, 2, proc)
        os.kill(run_processes(str(run_dir))["ref_infer0"], signal.SIGKILL)
        out, _ = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert "process 'ref_infer0' was killed by signal 9: restarted, the run goes on" in out, out[-3000:]
    assert "recover:" not in out  # the run itself was never restarted
    summary = check_accounting(run_dir, eta=RECIPE_ETA)
    assert summary["steps"] == 10 and summary["resumes"] == 0
    # Every step trained with the ref model's logprobs joined (the KL term ran on every step).
    assert all("train/kl_sum" in m for m in steps_of(run_dir))
