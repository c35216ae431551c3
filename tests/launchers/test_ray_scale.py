"""`python -m areal_flow.scale` on a run the Ray launcher started (launchers/ray_cluster.py `place`
and `retire`): a generation server added on a placement group of its own serves and, removed,
releases it; the trainer resized 1 -> 2 -> 1 reuses its first rank's bundle; the ledger stays clean
and the cluster gets every CPU back when the run ends."""

import signal
import subprocess
import sys
import time

import pytest
from run_helpers import RECIPE_ETA, SMALL, check_accounting, jsonl, steps_of, wait_for_step

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

pytestmark = pytest.mark.cluster  # a Ray cluster of its own: the cluster tier (README)


def scale(run_dir, change: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "areal_flow.scale", str(run_dir), change, "--timeout", "120"],
                          capture_output=True, text=True, timeout=180)


def test_servers_and_trainer_ranks_scale_on_a_ray_cluster(tmp_path, run_cache):
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4})
    run_dir = tmp_path / "run"
    try:
        proc = subprocess.Popen([sys.executable, "-m", "areal_flow.launch", *SMALL, f"cache_dir={run_cache}",
                                 f"hydra.run.dir={run_dir}", "launcher.type=ray", f"launcher.ray_address={cluster.address}",
                                 "cluster.n_devices=4", "eval_at_start=false", "eval_at_end=false", "total_steps=1000"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
        try:
            wait_for_step(run_dir, 1, proc, timeout=300)
            up = scale(run_dir, "generate=+1")
            assert up.returncode == 0 and "added gen_server1" in up.stdout, up.stdout + up.stderr
            resized = scale(run_dir, "trainers=2")
            assert resized.returncode == 0 and "trainer ranks 1 -> 2" in resized.stdout, resized.stdout + resized.stderr
            beyond = scale(run_dir, "generate=+1")  # 4 devices: a server, 2 ranks and gen_server1
            assert beyond.returncode == 2 and "free: none of 4 (cluster.n_devices)" in beyond.stdout, beyond.stdout
            wait_for_step(run_dir, len(steps_of(run_dir)) + 2, proc)
            assert jsonl(run_dir / "trained-rank1.jsonl")
            for change in ("trainers=1", "generate=-1"):
                out = scale(run_dir, change)
                assert out.returncode == 0, out.stdout + out.stderr
            wait_for_step(run_dir, len(steps_of(run_dir)) + 2, proc)
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=120)
        finally:
            proc.kill()
        assert proc.returncode == 130, out[-3000:]
        assert "run failed" not in out
        check_accounting(run_dir, eta=RECIPE_ETA)
        events = [e for e in jsonl(run_dir / "ledger.jsonl") if e["event"] == "scale"]
        assert [e["trainers"] for e in events if "trainers" in e] == [{"from": 1, "to": 2}, {"from": 2, "to": 1}]
        ray.init(address=cluster.address)
        try:  # every placement group the run and its scales made is gone
            deadline = time.time() + 10
            while ray.available_resources().get("CPU") != 4.0 and time.time() < deadline:
                time.sleep(0.5)
            assert ray.available_resources().get("CPU") == 4.0
        finally:
            ray.shutdown()
    finally:
        cluster.shutdown()
