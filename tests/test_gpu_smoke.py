"""recipes/gpu_smoke.yaml: validated and placed on the CPU, and 10 steps on a GPU (gpu-marked;
tools/gpu_check.sh runs it)."""

import subprocess
import sys

import pytest
from run_helpers import check_accounting, launch_recipe, steps_of


def test_the_gpu_smoke_recipe_validates_and_places_both_sides_on_the_one_gpu(tmp_path):
    """Every check a run makes before it starts (the dry run skips only the look for a GPU); the
    colocated path it takes runs on the CPU in test_recipe_variants.py."""
    r = subprocess.run([sys.executable, "-m", "areal_flow.launch", "recipe=gpu_smoke", "dry_run=true"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "colocated: generation and training take turns on mesh 0" in r.stdout
    assert "gen_server0    gpu 0" in r.stdout and "trainer0       gpu 0" in r.stdout
    assert "--device cuda --dtype auto --mem-fraction-static 0.3" in r.stdout


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
