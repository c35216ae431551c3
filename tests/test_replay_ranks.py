"""Replay of a run of two trainer ranks (data parallel over gloo): `python -m areal_flow.replay`
starts the second rank beside the first, each replays its own record, and every step's weights
equal the run's on both; the dumped per-token loss terms of both ranks add up to the loss the
step minimised; a changed record is caught at its step with the weights' largest difference where
the run saved them; a rank whose record is broken stops the replay naming the rank and the file,
and leaves no process behind."""

import json
import shutil
import subprocess

import numpy as np
import pytest
from run_helpers import ANSWERS_SOME, change_a_trained_logprob, launch, replay

from areal_flow.training import flight

pytestmark = pytest.mark.slow

BASE_MODELS = [ANSWERS_SOME]  # bootstrapped ahead by conftest.py
STEPS = 6
RUN = ("rollout.max_staleness=2", "rollout.interrupt=true", f"total_steps={STEPS}", "eval_at_start=false",
       "eval_at_end=false", *ANSWERS_SOME, "rollout.max_concurrent=2", "checkpoint.every_steps=3",
       # two trainer ranks on devices 1-2 (the generator on 0)
       "cluster.n_devices=3", "launcher.pin_cpus=false", "graph.actor_prox.mesh=1-2", "graph.actor_train.mesh=1-2")


@pytest.fixture(scope="module")
def two_ranks(run_cache, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("replay_ranks") / "run"
    done = launch(run_dir, run_cache, *RUN)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return run_dir


def copy(run_dir, tmp_path):
    target = tmp_path / "run"
    shutil.copytree(run_dir, target, ignore=shutil.ignore_patterns("checkpoint", "weights", "replay", "logs", "dumps"))
    return target


def test_both_ranks_replay_bit_for_bit_and_their_loss_terms_add_up_to_the_steps_loss(two_ranks):
    assert flight.recorded_steps(str(two_ranks), 0) == flight.recorded_steps(str(two_ranks), 1) == list(range(STEPS))
    dumps = [arg for step in range(1, STEPS + 1) for arg in ("--dump", str(step))]
    whole = replay(two_ranks, *dumps)
    assert whole.returncode == 0 and f"all {STEPS} steps equal" in whole.stdout, whole.stdout[-3000:] + whole.stderr[-3000:]
    resumed = replay(two_ranks, "--from-step", "5")
    assert resumed.returncode == 0 and "all 3 steps equal" in resumed.stdout, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "checkpoints/step-00000003" in resumed.stdout
    with_loss = 0
    for step in range(STEPS):
        records = [flight.read(str(two_ranks), step, rank) for rank in (0, 1)]
        folder = two_ranks / "replay" / f"step-{step + 1:08d}"
        rows = [[json.loads(line) for line in (folder / f"tokens-rank{r}.jsonl").read_text().splitlines()]
                for r in (0, 1)]
        assert [[row["uid"] for row in part] for part in rows] == [[s.uid for s in r.samples] for r in records]
        loss = records[0].stats.get("loss")  # (the step's stats, summed over the ranks)
        if loss is None or np.isnan(loss):
            continue  # no answer of the step had a gradient
        with_loss += 1
        terms = np.concatenate([row["loss_term"] for part in rows for row in part])
        # The same sum up to rounding: the dump's logprobs come from the inference forward, the
        # step's from the training forward (equal within ~1e-6), and positive and negative terms
        # cancel in a loss near 0, so the bound is relative to the terms' magnitude.
        assert abs(terms.sum() - loss) <= 1e-5 * np.abs(terms).sum() + 1e-9, (step, terms.sum(), loss)
        for row in (row for part in rows for row in part):
            pushed = np.array(row["loss_grad"]) != 0
            assert not np.any(pushed & (np.array(row["in_loss"]) == 0))  # only tokens in the loss are pushed
    assert with_loss >= 1, "no step had an answer with a gradient"


def test_a_changed_record_is_caught_at_its_step_with_the_largest_weight_difference(two_ranks, tmp_path):
    run_dir = copy(two_ranks, tmp_path)
    step = change_a_trained_logprob(run_dir, range(1, STEPS), 1, -1e-2)  # rank 1's, from step 2 on
    changed = replay(run_dir)
    assert changed.returncode == 1, changed.stdout[-3000:] + changed.stderr[-3000:]
    assert f"the first is step {step + 1}" in changed.stdout and "differ on rank" in changed.stdout
    # Step 6 has a checkpoint: the weights' difference is measured there.
    assert "largest |Δ weight|" in changed.stdout and "where the run saved its weights" in changed.stdout


def test_a_rank_whose_record_is_broken_stops_the_replay_naming_it(two_ranks, tmp_path):
    run_dir = copy(two_ranks, tmp_path)
    broken = flight.path_of(str(run_dir), 1, 1)
    with open(broken, "wb") as f:
        f.write(b"not msgpack")
    failed = replay(run_dir)
    assert failed.returncode == 2, failed.stdout[-3000:] + failed.stderr[-3000:]
    assert "rank 1 of the replay stopped" in failed.stdout and f"{broken}: not a flight record" in failed.stdout
    left = subprocess.run(["pgrep", "-f", f"areal_flow.replay {run_dir}"], capture_output=True, text=True)
    assert left.stdout == ""
