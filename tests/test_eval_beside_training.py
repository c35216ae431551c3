"""Held-out evaluation beside training: pinned to a version, the trainer going on meanwhile."""

import pytest
from run_helpers import check_accounting, jsonl, launch

pytestmark = pytest.mark.slow

BASE_MODELS = [("dataset.n_eval=400",)]  # its held-out set's own base model, bootstrapped ahead by conftest.py


def test_evaluation_runs_beside_the_trainer_on_one_version(tmp_path, run_cache):
    run_dir = tmp_path / "run"
    # 400 held-out prompts: an evaluation outlasts a train step on this machine.
    r = launch(run_dir, run_cache, "eval_at_start=false", "eval_at_end=false", "eval.every_versions=2",
               "dataset.n_eval=400", "rollout.max_staleness=2", "metrics.backends=[jsonl,tensorboard]")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    check_accounting(run_dir, eta=2)
    rows = jsonl(run_dir / "metrics.jsonl")
    evals = [m for m in rows if m["event"] == "eval"]
    assert [(e["when"], e["version"]) for e in evals] == [("version 2", 2), ("version 4", 4)]
    for e in evals:  # every answer came wholly from the version pinned
        assert e["answer_versions"] == {str(e["version"]): 400} and e["n"] == 400, e
        assert 0 <= e["accuracy"] <= 1 and len(e["samples"]) == 4 and "answer" in e["samples"][0]
    # The trainer went on while version 2 was evaluated: step 3 trained meanwhile ...
    assert evals[0]["trainer_steps_meanwhile"] >= 1, evals[0]
    # ... and the servers loaded version 3 only once the evaluation had ended.
    ledger = jsonl(run_dir / "ledger.jsonl")
    loaded_v3 = next(e for e in ledger if e["event"] == "loaded" and e["version"] == 3)
    assert loaded_v3["time"] >= evals[0]["time"] - 0.05
    assert "held-out accuracy at version 2" in r.stdout
    # The run's TensorBoard files hold the step rows and the evaluations at their versions.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("eval/accuracy")] == [(e["step"], e["accuracy"]) for e in evals]
    assert [e.step for e in events.Scalars("reward")] == [1, 2, 3, 4]
    assert "staleness_hist" in events.Tags()["histograms"]
