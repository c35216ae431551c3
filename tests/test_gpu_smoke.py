"""recipes/gpu_smoke.yaml and gpu_smoke_code.yaml: validated and placed on the CPU, and 10 steps on a
GPU (gpu-marked; tools/gpu_check.sh runs them)."""

import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from run_helpers import check_accounting, launch_recipe, steps_of

from areal_flow.launch import CONF_DIR
from areal_flow.runtime.spec import typed


def test_the_gpu_smoke_recipe_validates_and_places_both_sides_on_the_one_gpu(tmp_path):
    """Every check a run makes before it starts (the dry run skips only the look for a GPU); the
    colocated path it takes runs on the CPU in test_recipe_variants.py."""
    r = subprocess.run([sys.executable, "-m", "areal_flow.launch", "recipe=gpu_smoke", "dry_run=true"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "colocated: generation and training take turns on mesh 0" in r.stdout
    assert "gen_server0    gpu 0" in r.stdout and "trainer0       gpu 0" in r.stdout
    assert "--device cuda --dtype auto --mem-fraction-static 0.3" in r.stdout


def recipe(name: str):
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        return typed(compose("config", overrides=["output_dir=/tmp/unused", f"recipe={name}"]))


def test_the_code_recipe_is_the_smoke_recipe_with_the_code_graph_and_sixteen_sandboxed_workers(tmp_path):
    """gpu_smoke_code: gpu_smoke's shape, placement and CUDA IPC updates, with code_tiny's data and
    reward node; every check a run makes before it starts passes (the sandbox's among them)."""
    smoke, code = recipe("gpu_smoke"), recipe("gpu_smoke_code")
    assert smoke.rollout.weight_update_mode == code.rollout.weight_update_mode == "ipc"
    assert code.model.arch["hidden_size"] == smoke.model.arch["hidden_size"] == 896
    assert code.dataset.name == "tiny_code" and code.algorithm.max_new_tokens == 128
    reward = code.graph["reward"]
    assert (reward.fn, reward.workers, reward.inputs) == ("code", 16, ["output_ids", "input_output"])
    r = subprocess.run([sys.executable, "-m", "areal_flow.launch", "recipe=gpu_smoke_code", "dry_run=true"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "reward: reward on 16 worker(s)" in r.stdout and "<- input_output (from dataset)" in r.stdout
    assert "gen_server0    gpu 0" in r.stdout and "trainer0       gpu 0" in r.stdout


@pytest.mark.gpu
def test_the_gpu_smoke_recipe_runs_ten_steps_on_a_gpu(tmp_path, run_cache):
    run_dir = tmp_path / "gpu_smoke"
    r = launch_recipe(run_dir, run_cache, "gpu_smoke", "total_steps=10", "algorithm.batch_size=16",
               "algorithm.group_size=16", "rollout.max_concurrent=128", "model.bootstrap_steps=300",
               "model.bootstrap_batch_size=64")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    steps = steps_of(run_dir)
    assert len(steps) == 10 and all(m["gen/memory_releases"] == 1 for m in steps)
    check_accounting(run_dir, eta=4, group_size=16)
