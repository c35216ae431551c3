"""A user's environment with bugs, in real runs (docs/agents.md, "When rollouts fail"): a step()
that raises now and then ends that trajectory only, its group dropped by name in the ledger and the
error counted in the step rows, the run going on with no process restarted; one that always raises
stops the run with one line naming it, its error and the key; and an environment that does not
import stops the launch before the data and the model are made."""

import os
import re
from pathlib import Path

import pytest
from run_helpers import RECIPE_ETA, check_accounting, jsonl, launch, leftover_processes, steps_of

pytestmark = pytest.mark.slow

ENVS = str(Path(__file__).parent / "envs")
MULTI_TURN = ("+graph.generate.env=flaky_env:Flaky", "graph.generate.max_turns=3",
              "graph.generate.outputs=[prompt_ids,output_ids,behav_logprobs,versions,loss_mask]",
              "graph.actor_train.inputs=[prompt_ids,output_ids,behav_logprobs,versions,prox_logprobs,rewards,"
              "loss_mask]", "eval_at_start=false", "eval_at_end=false")
ERROR = r"step\(\) raised at flaky_env.py:\d+ in step: RuntimeError: the tool failed at call \d+"


@pytest.fixture(autouse=True)
def flaky_importable(monkeypatch):
    """The launcher and its processes import the test's environment by its module path."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [ENVS, os.environ.get("PYTHONPATH")])))


def test_an_environment_that_raises_1_call_in_8_costs_its_groups_counted_and_the_run_goes_on(tmp_path, run_cache):
    run_dir = tmp_path / "flaky"
    r = launch(run_dir, run_cache, *MULTI_TURN, "total_steps=3")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "restarted" not in out  # no rollout worker died for it
    check_accounting(run_dir, eta=RECIPE_ETA, drops=True)  # every group trained once or dropped once
    ledger = jsonl(run_dir / "ledger.jsonl")
    drops = [e for e in ledger if e["event"] == "drop"]
    assert drops, "no step() raised: the test's environment was never called"
    for e in drops:
        assert re.fullmatch(rf"environment flaky_env:Flaky raised in [1-4] of 4 trajectories: {ERROR}", e["reason"]), e
    errors = [int(re.search(r"raised in (\d)", e["reason"]).group(1)) for e in drops]
    # Each step row counts the errors of the groups scored since the row before: those before the
    # last step's batch was taken are all in the rows, none counted twice.
    last_train = max(i for i, e in enumerate(ledger) if e["event"] == "train")
    before = sum(n for e, n in zip(drops, errors) if ledger.index(e) < last_train)
    steps = steps_of(run_dir)
    assert len(steps) == 3 and all(m["env/errors"] >= 0 and 0 <= m["env/error_share"] <= 1 for m in steps)
    assert before <= sum(m["env/errors"] for m in steps) <= sum(errors)
    assert not leftover_processes(run_dir)


def test_an_environment_that_always_raises_stops_the_run_with_one_line_naming_it(tmp_path, run_cache):
    run_dir = tmp_path / "broken"
    r = launch(run_dir, run_cache, *MULTI_TURN, "+graph.generate.env_settings.every=1",
               "+graph.generate.env_settings.stops=';=#'", "step_timeout=300", "launcher.stop_timeout=2")
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-3000:]
    (line,) = [line for line in out.splitlines() if line.startswith("run failed:")]  # the run's one line
    assert re.search(r"environment flaky_env:Flaky raised in \d+ of the last \d+ trajectories, more than "
                     rf"graph.generate.env_error_share=0.5 of 200; the last: environment flaky_env:Flaky raised in "
                     rf"[1-4] of 4 trajectories: {ERROR}", line), line
    assert "restarted" not in out
    assert not leftover_processes(run_dir)


def test_an_environment_that_does_not_import_stops_the_launch_before_the_data_and_model(tmp_path):
    cache = tmp_path / "fresh_cache"  # nothing bootstrapped: a first run would train its model for minutes
    r = launch(tmp_path / "missing", cache, *MULTI_TURN[1:], "+graph.generate.env=flaky_env:Flakey")
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    assert "error: invalid config:" in r.stdout and "graph.generate.env: 'flaky_env' has no callable 'Flakey'" in r.stdout
    assert not (cache / "models").exists() and not (cache / "data").exists()
