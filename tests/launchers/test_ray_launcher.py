"""launcher.type=ray on a Ray cluster of two nodes on this host (Ray's own multi-node test cluster):
each node runs the processes the placement gives it, the run trains, and a process that dies
stops the run with its name and leaves nothing behind."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from run_helpers import RECIPE_ETA, SMALL, check_accounting, jsonl, run_processes

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

pytestmark = pytest.mark.cluster  # a Ray cluster of its own: the cluster tier (README)

# Generation on the first node's core, training on the second's.
TWO_NODES = ("launcher.type=ray", "cluster.n_nodes=2", "cluster.n_devices=1", "eval_at_start=false")


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    c.add_node(num_cpus=1)
    c.wait_for_nodes()
    yield c
    c.shutdown()


@contextlib.contextmanager
def connected(cluster):
    ray.init(address=cluster.address)
    try:
        yield
    finally:
        ray.shutdown()


def start(run_dir, cache, cluster, *overrides) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "areal_flow.launch", *SMALL, f"cache_dir={cache}", f"hydra.run.dir={run_dir}",
           *TWO_NODES, f"launcher.ray_address={cluster.address}", *overrides]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=run_dir.parent)


def ray_nodes_of(run_dir) -> dict[str, str]:
    return {name: p["node_id"] for name, p in json.loads((run_dir / "ray_placement.json").read_text()).items()}


def wait_for_a_step(p: subprocess.Popen, run_dir, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert p.poll() is None, p.stdout.read()[-4000:]
        metrics = run_dir / "metrics.jsonl"
        if metrics.exists() and any(m["event"] == "step" for m in jsonl(metrics)):
            return
        time.sleep(0.5)
    raise AssertionError(f"no train step within {timeout} s")


def test_each_node_runs_its_processes_and_the_run_trains(tmp_path, run_cache, cluster):
    run_dir = tmp_path / "ray"
    p = start(run_dir, run_cache, cluster)
    out, _ = p.communicate(timeout=400)
    assert p.returncode == 0, out[-4000:]
    check_accounting(run_dir, eta=RECIPE_ETA)
    nodes = ray_nodes_of(run_dir)
    # Placement node 0 (the generation server and the light processes) and node 1 (the trainer)
    # landed on two different Ray nodes.
    assert nodes["gen_server0"] == nodes["controller"] != nodes["trainer0"]
    with connected(cluster):
        assert {n["NodeID"] for n in ray.nodes() if n["Alive"]} >= set(nodes.values())
    # Every listening process was reached at its node's address, not loopback, and the run spanned
    # nodes, so it was secured (docs/security.md).
    placed = json.loads((run_dir / "ray_placement.json").read_text())
    spec = json.loads((run_dir / "spec.json").read_text())
    assert spec["hosts"]["trainer0"] == placed["trainer0"]["address"] != "127.0.0.1"
    assert spec["hosts"]["gen_server0"] == placed["gen_server0"]["address"] and spec["security"] is not None
    assert not run_processes(run_dir)


def test_a_process_that_dies_stops_the_run_naming_it_and_releases_the_cluster(tmp_path, run_cache, cluster):
    run_dir = tmp_path / "dies"
    p = start(run_dir, run_cache, cluster, "total_steps=50")
    wait_for_a_step(p, run_dir)
    # A rollout worker that dies is restarted by its actor, on its node, and the run goes on.
    os.kill(run_processes(run_dir)["rollout0"], signal.SIGKILL)
    steps = len([m for m in jsonl(run_dir / "metrics.jsonl") if m["event"] == "step"])
    deadline = time.time() + 120
    while len([m for m in jsonl(run_dir / "metrics.jsonl") if m["event"] == "step"]) < steps + 2:
        assert p.poll() is None and time.time() < deadline, "the run did not go on after rollout0 died"
        time.sleep(0.5)
    # An abort, as a crash in native code (torch, a collective library) ends: the report carries
    # the stacks faulthandler wrote into the process's log.
    os.kill(run_processes(run_dir)["trainer0"], signal.SIGABRT)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 1
    assert "process 'rollout0' was killed by signal 9: restarted, the run goes on" in out
    assert "process 'trainer0' was killed by signal 6" in out
    assert "Fatal Python error: Aborted" in out and "(most recent call first)" in out
    assert not run_processes(run_dir)
    # The run's placement groups and actors are gone: the cluster has all its CPUs for the next run.
    with connected(cluster):
        time.sleep(1)
        assert ray.available_resources().get("CPU") == 2.0
