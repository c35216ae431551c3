"""launcher.type=ray on a Ray cluster whose two nodes have addresses of their own: a Ray head in one
network namespace, a Ray node in the other (netns_hosts.py). The run's processes talk across the
two addresses (ZeroMQ, HTTP, the weights as files on the shared disk); `python -m areal_flow.scale`
adds a generation server, which lands on the other node and serves from there (the scale
handshake across addresses); then that node dies, the run stops naming it, and once the node is
back `resume=auto` goes on with every group trained once or accounted for."""

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request

import pytest
from netns_hosts import Hosts
from run_helpers import RECIPE_ETA, check_accounting, small_with, steps_of, wait_for_step

pytest.importorskip("ray")

pytestmark = pytest.mark.cluster

RAY = os.path.join(os.path.dirname(sys.executable), "ray")
RAY_PORT = 6379  # each node has its own ports: the namespaces share none


def start_node(hosts: Hosts, k: int, temp: str) -> None:
    """`ray start` in host k's namespace: the head on host 0, a node joining it on the others."""
    role = ["--head", f"--port={RAY_PORT}", "--include-dashboard=false"] if k == 0 else \
        [f"--address={hosts.addresses[0]}:{RAY_PORT}"]
    r = subprocess.run(hosts.command(k, [RAY, "start", *role, f"--node-ip-address={hosts.addresses[k]}",
                                         "--num-cpus=2", "--disable-usage-stats", f"--temp-dir={temp}{k}"]),
                       capture_output=True, text=True, timeout=120, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


@pytest.fixture(scope="module")
def ray_hosts():
    hosts = Hosts(2, tag=f"ar{os.getpid() % 100000}").up()
    temp = f"/tmp/ar{os.getpid()}-"  # Ray's socket paths must stay short: not under pytest's tmp_path
    try:
        for k in range(2):
            start_node(hosts, k, temp)
        yield hosts, temp
    finally:
        hosts.down()
        for k in range(2):
            shutil.rmtree(f"{temp}{k}", ignore_errors=True)


def scale(run_dir, change: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "areal_flow.scale", str(run_dir), change, "--timeout", "120"],
                          capture_output=True, text=True, timeout=180)


def launch(hosts: Hosts, run_dir, cache, *overrides: str) -> subprocess.Popen:
    """The launcher, a Ray driver, on the head's host; the allocation puts the generation servers on
    node 0's two cores and the trainer on node 1's first, leaving node 1 a free core."""
    argv = [sys.executable, "-m", "areal_flow.launch", f"cache_dir={cache}", f"hydra.run.dir={run_dir}",
            "launcher.type=ray", f"launcher.ray_address={hosts.addresses[0]}:{RAY_PORT}", "cluster.n_nodes=2",
            "cluster.n_devices=2", "allocation=embedded:d2 + torch:d1", "eval_at_start=false", "eval_at_end=false",
            *small_with(*overrides)]
    return subprocess.Popen(hosts.command(0, argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=run_dir.parent)


def requests_served(url: str) -> float:
    """What a generation server's /metrics (open without the run's API key) counts as requests."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        return float(re.search(r"^sglang:num_requests_total\{.*\} (\S+)$", r.read().decode(), re.M).group(1))


def test_a_run_across_two_addresses_scales_onto_the_other_node_and_stops_naming_a_node_that_dies(
        ray_hosts, run_cache, tmp_path):
    hosts, temp = ray_hosts
    first, second = hosts.addresses
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    proc = launch(hosts, run_dir, run_cache, "total_steps=1000", "checkpoint.every_steps=3")
    try:
        wait_for_step(run_dir, 1, proc, timeout=300)
        # Ray chooses which of its nodes holds each placement node's group: the servers on one
        # address, the trainer on the other.
        placed = json.loads((run_dir / "ray_placement.json").read_text())
        servers, trainer = placed["gen_server0"]["address"], placed["trainer0"]["address"]
        assert {servers, trainer} == {first, second} and placed["gen_server1"]["address"] == servers
        assert placed["controller"]["address"] == servers  # the light processes beside the first node's group
        up = scale(run_dir, "generate=+1")
        assert up.returncode == 0 and "added gen_server2" in up.stdout, up.stdout + up.stderr
        # The new server runs on the trainer's node (its only free core), away from the rollout
        # worker and the other servers, joined the run at its own address, and serves.
        placed = json.loads((run_dir / "ray_placement.json").read_text())
        assert placed["gen_server2"]["address"] == trainer
        url = json.loads((run_dir / "servers.json").read_text())["servers"]["gen_server2"]["url"]
        assert url.startswith(f"http://{trainer}:")
        deadline = time.monotonic() + 120  # the router sends it requests as it takes them
        while requests_served(url) == 0:
            assert proc.poll() is None and time.monotonic() < deadline, "gen_server2 served no request"
            time.sleep(0.5)
        wait_for_step(run_dir, len(steps_of(run_dir)) + 2, proc)
        assert any((run_dir / "checkpoints").glob("*/manifest.json"))
        # The second host (not the head's, which holds the cluster's GCS and the launcher) loses
        # power: its raylet and the run's processes there are gone at once.
        assert hosts.kill(1)
        out, _ = proc.communicate(timeout=180)
    finally:
        proc.kill()
    assert proc.returncode == 1, out[-3000:]
    failed = next(line for line in out.splitlines() if line.startswith("run failed:"))
    named = re.search(rf"process '(\w+)' was killed by signal 9: its Ray actor on node [01] "
                      rf"\({re.escape(second)}(, which Ray reports dead)?\) is gone", failed)
    assert named and placed[named.group(1)]["address"] == second, failed
    # The node comes back; the run goes on from its last checkpoint and loses no group.
    start_node(hosts, 1, temp)
    steps = len(steps_of(run_dir))
    proc = launch(hosts, run_dir, run_cache, f"total_steps={steps + 3}", "checkpoint.every_steps=3", "resume=auto")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    summary = check_accounting(run_dir, eta=RECIPE_ETA)
    assert summary["resumes"] == 1 and summary["steps"] == steps + 3
