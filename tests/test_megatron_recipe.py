"""recipes/tiny_arith_megatron.yaml end to end: the actor on the megatron engine, in the real system.

Run as shipped (one trainer core), and with the model split over two trainer ranks by tensor
parallelism, where both ranks must train the same samples and every sample exactly once.
"""

import json

import pytest
import torch
import transformers
from run_helpers import ANSWERS_SOME, check_accounting, jsonl, launch_recipe, steps_of

pytestmark = pytest.mark.slow

BASE_MODELS = [ANSWERS_SOME]  # bootstrapped ahead by conftest.py


def _trained(run_dir, rank):
    return [u for row in jsonl(run_dir / f"trained-rank{rank}.jsonl") for u in row["uids"]]


TRAINING = (*ANSWERS_SOME, "rollout.max_staleness=1", "eval_at_start=false", "eval_at_end=false")


def _check_run(run_dir):
    summary = check_accounting(run_dir, eta=1, group_size=8)
    assert summary["steps"] == 4
    steps = steps_of(run_dir)
    assert all(m["train/skipped_steps"] == 0 for m in steps) and any(m["train/grad_norm"] > 0 for m in steps)
    # The checkpoint is a Hugging Face directory whose weights moved away from the start model.
    trained = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "checkpoint", dtype=torch.float32)
    model_path = json.loads((run_dir / "spec.json").read_text())["model_path"]
    start = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    moved = [not torch.equal(a, b) for a, b in zip(trained.parameters(), start.parameters())]
    assert all(moved)
    return summary


def test_the_megatron_recipe_trains_as_shipped(tmp_path, run_cache):
    run_dir = tmp_path / "run"
    r = launch_recipe(run_dir, run_cache, "tiny_arith_megatron", *TRAINING)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    _check_run(run_dir)


def test_two_tensor_parallel_ranks_train_every_sample_once_together(tmp_path, run_cache):
    run_dir = tmp_path / "run"
    r = launch_recipe(run_dir, run_cache, "tiny_arith_megatron", *TRAINING, "cluster.n_devices=3", "launcher.pin_cpus=false", "graph.actor_prox.mesh=1-2",
               "graph.actor_train.mesh=1-2", "graph.actor_prox.parallel=t2", "graph.actor_train.parallel=t2")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = _check_run(run_dir)
    # The controller spread the groups over both ranks; the TP group trained their union, once,
    # and its first rank logged it.
    assert len(_trained(run_dir, 0)) == summary["trained_samples"] and _trained(run_dir, 1) == []


def test_a_layout_the_model_cannot_take_is_refused_before_any_process_starts(tmp_path, run_cache):
    run_dir = tmp_path / "run"
    r = launch_recipe(run_dir, run_cache, "tiny_arith_megatron", "cluster.n_devices=4", "launcher.pin_cpus=false",
               "graph.actor_prox.mesh=1-3", "graph.actor_train.mesh=1-3", "graph.actor_prox.parallel=p3",
               "graph.actor_train.parallel=p3")
    assert r.returncode != 0
    assert "graph.actor_prox.parallel with model" in r.stderr + r.stdout
    assert "pp=3 does not divide the model's 4 layers" in r.stderr + r.stdout
    assert not list(run_dir.glob("trained-rank*.jsonl"))  # no trainer ever started
