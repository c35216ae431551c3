"""A trainer rank with no samples in a step: the batch has fewer groups than there are ranks."""

import pytest
from run_helpers import check_accounting, jsonl, launch, steps_of

pytestmark = pytest.mark.slow


def test_a_rank_without_groups_takes_part_in_the_step_and_the_run_trains_every_group_once(tmp_path, run_cache):
    run_dir = tmp_path / "run"
    # One group a step over two ranks; advantages normalised by group mean and batch std, so the
    # empty rank joins the all-reduces with nothing (normalize on [0, 0]).
    r = launch(run_dir, run_cache, "total_steps=3", "algorithm.batch_size=1", "eval_at_start=false",
               "eval_at_end=false", "cluster.n_devices=3", "launcher.pin_cpus=false", "graph.actor_prox.mesh=1-2",
               "graph.actor_train.mesh=1-2", "algorithm.adv_norm.mean_level=group", "algorithm.adv_norm.std_level=batch")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    check_accounting(run_dir, eta=2)
    per_rank = [jsonl(run_dir / f"trained-rank{k}.jsonl") for k in (0, 1)]
    for step in range(3):  # each step's one group on one rank; the other trained nothing
        uids = [rows[step]["uids"] for rows in per_rank]
        assert sorted(len(u) for u in uids) == [0, 4], uids
    assert [m["step"] for m in steps_of(run_dir)] == [1, 2, 3]
