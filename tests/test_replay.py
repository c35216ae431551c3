"""Replay (`python -m areal_flow.replay`): an asynchronous run (η = 4, updates cutting answers) whose
trainer was killed (kill -9) and restarted from a checkpoint is replayed from its flight record alone,
from the start and from the checkpoint, and every step ends with the run's weights bit for bit; a
record with one logprob changed is caught at its step; `--dump` writes a step for inspection; an
answer cut by an update regenerates to the same tokens and logprobs from the weights of its two
versions; a run that cannot be replayed is refused by name."""

import json
import os
import shutil

import numpy as np
import pytest
from run_helpers import ANSWERS_SOME, change_a_trained_logprob, kill_trainer_after_checkpoint, replay, steps_of
from test_resume_end_to_end import start

from areal_flow.training import flight

pytestmark = pytest.mark.slow

BASE_MODELS = [ANSWERS_SOME]  # bootstrapped ahead by conftest.py
RUN = ("rollout.max_staleness=4", "rollout.interrupt=true", "total_steps=8", "eval_at_start=false",
       "eval_at_end=false", *ANSWERS_SOME, "checkpoint.every_steps=3", "checkpoint.keep_last=3", "recover.retries=1",
       # Two groups decoding at once: the generator is busy when each update lands, so updates cut
       # answers however loaded the machine is (at 8, CI once saw none cut in 8 steps).
       "rollout.max_concurrent=2",
       # for regeneration: servers that decode batch-invariantly, and every version's weights kept
       "generation.deterministic=true", "dump.weights=true")


@pytest.fixture(scope="module")
def killed_run(run_cache, tmp_path_factory):
    """An η = 4 run whose trainer is killed once its checkpoint of step 3 is complete; the launcher
    restarts the run from it (recover.retries) and it ends at step 8."""
    run_dir = tmp_path_factory.mktemp("replay") / "run"
    run_dir.mkdir()
    proc = start(run_dir, run_cache, *RUN)
    out = kill_trainer_after_checkpoint(run_dir, proc, 3)
    assert proc.returncode == 0 and "recover: restart 1 of 1" in out, out[-3000:]
    return run_dir


def test_an_async_run_killed_and_resumed_replays_bit_for_bit_from_the_start_and_from_its_checkpoint(killed_run):
    steps = steps_of(killed_run)
    assert len(steps) == 8 and max(s["staleness_max"] for s in steps) >= 1  # asynchronous: older samples trained
    assert flight.recorded_steps(str(killed_run)) == list(range(8))
    records = [flight.read(str(killed_run), step) for step in range(8)]
    versions = next(key for key in records[0].samples[0].arrays if "version" in key)
    cut = [s for r in records for s in r.samples if len(np.unique(s.array(versions))) > 1]
    assert cut, "no trained answer was cut by an update (its tokens from two versions)"
    whole = replay(killed_run, "--dump", "2")
    assert whole.returncode == 0 and "all 8 steps equal" in whole.stdout, whole.stdout[-3000:] + whole.stderr[-3000:]
    assert "from the base model" in whole.stdout
    resumed = replay(killed_run, "--from-step", "5")
    assert resumed.returncode == 0 and "all 5 steps equal" in resumed.stdout, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "checkpoints/step-00000003" in resumed.stdout  # steps 4-8 from the checkpoint after step 3
    # --dump 2: the step's batch, its tokens' logprobs before the update and ratios, the weights after.
    folder = killed_run / "replay" / "step-00000002"
    rows = [json.loads(line) for line in (folder / "tokens-rank0.jsonl").read_text().splitlines()]
    assert len(rows) == len(flight.read(str(killed_run), 1).samples)
    assert all(len(r["ratio"]) == len(r["logprobs_before"]) == len(r["advantages"]) for r in rows)
    assert (folder / "weights" / "config.json").exists()


def test_an_answer_cut_by_an_update_regenerates_to_its_tokens_and_logprobs_bit_for_bit(killed_run):
    records = [flight.read(str(killed_run), step) for step in range(8)]
    versions = next(key for key in records[0].samples[0].arrays if "version" in key)
    step, sample = next((r.step, s) for r in reversed(records) for s in r.samples
                        if len(np.unique(s.array(versions))) > 1)
    done = replay(killed_run, "--regenerate", f"{step + 1}:{sample.uid}")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "equal: the same" in done.stdout
    assert done.stdout.count("tokens of version") >= 2  # spans of two versions or more, each regenerated


def test_a_record_changed_by_one_logprob_is_caught_at_its_step(killed_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(killed_run, run_dir, ignore=shutil.ignore_patterns("checkpoint", "weights", "replay", "logs", "dumps"))
    step = change_a_trained_logprob(run_dir, range(4, 8), 0, -1e-3)  # from step 5 on
    changed = replay(run_dir, "--from-step", "5")
    assert changed.returncode == 1, changed.stdout[-3000:] + changed.stderr[-3000:]
    assert f"the first is step {step + 1}" in changed.stdout


def test_a_run_that_cannot_be_replayed_is_refused_naming_why(killed_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(killed_run, run_dir, ignore=shutil.ignore_patterns("checkpoint", "weights", "replay", "logs", "dumps"))
    os.remove(flight.path_of(str(run_dir), 6, 0))
    gap = replay(run_dir)
    assert gap.returncode == 2 and "has no step 7" in gap.stdout, gap.stdout[-2000:]
    backwards = replay(run_dir, "--from-step", "4", "--to-step", "2")
    assert backwards.returncode == 2 and "counted from 1" in backwards.stdout
    shutil.rmtree(run_dir / "flight")
    none = replay(run_dir)
    assert none.returncode == 2 and "no flight record" in none.stdout and "flight.record=true" in none.stdout
