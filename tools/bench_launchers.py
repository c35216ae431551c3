"""The Ray launcher against the local one: start-up, per-step time and shutdown on the tiny recipe.

Starts a Ray cluster of two nodes on this machine (Ray's own multi-node test cluster, one core
each) unless --ray-address names one, warms the model cache with a one-step local run, then runs
the same recipe for --steps steps with launcher.type=local and with launcher.type=ray (generation
on one node, training on the other). Prints a table and the ratios.

    python tools/bench_launchers.py [--steps 20] [--ray-address ADDR] [-- extra overrides]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time

from _bench import machine
from rich.console import Console

SMALL = ["algorithm.batch_size=2", "algorithm.group_size=4", "rollout.max_concurrent=8", "dataset.n_train=400",
         "dataset.n_eval=16", "model.bootstrap_steps=30", "model.bootstrap_batch_size=32", "max_wall_seconds=0",
         "eval_at_start=false", "eval_at_end=false", "metrics.plot=false"]


def timed_run(run_dir: str, overrides: list[str]) -> dict[str, float]:
    """Seconds from the command to the run's start event (processes up), per step after the first,
    and from the last step to the launcher's exit."""
    cmd = [sys.executable, "-m", "areal_flow.launch", *SMALL, *overrides, f"hydra.run.dir={run_dir}"]
    t0 = time.time()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    t_end = time.time()
    with open(f"{run_dir}/metrics.jsonl") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    start = next(r["time"] for r in rows if r["event"] == "start")
    steps = [r["time"] for r in rows if r["event"] == "step"]
    return {"startup": start - t0, "first_step": steps[0] - start,
            "per_step": (steps[-1] - steps[0]) / (len(steps) - 1), "shutdown": t_end - steps[-1], "total": t_end - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--ray-address", default=None, help="a running Ray cluster of two nodes (default: start one here)")
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    args = ap.parse_args()
    console = Console()
    cluster = None
    with tempfile.TemporaryDirectory() as tmp:
        common = [f"cache_dir={tmp}/cache", *args.overrides]
        with console.status("warming the model cache (one local step)"):
            timed_run(f"{tmp}/warm", [*common, "total_steps=2"])
        address = args.ray_address
        ray_up = float("nan")
        if address is None:
            from ray.cluster_utils import Cluster

            with console.status("starting a Ray cluster of two nodes"):
                t0 = time.time()
                cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
                cluster.add_node(num_cpus=1)
                cluster.wait_for_nodes()
                ray_up = time.time() - t0
                address = cluster.address
        try:
            results = {}
            for name, extra in (("local", []), ("ray", ["launcher.type=ray", f"launcher.ray_address={address}",
                                                         "cluster.n_nodes=2", "cluster.n_devices=1"])):
                with console.status(f"{name}: {args.steps} steps"):
                    results[name] = timed_run(f"{tmp}/{name}", [*common, f"total_steps={args.steps}", *extra])
        finally:
            if cluster is not None:
                cluster.shutdown()
    local, ray = results["local"], results["ray"]
    print(f"\nmachine: {machine()}")
    print(f"command: python tools/bench_launchers.py --steps {args.steps}")
    if ray_up == ray_up:
        print(f"Ray cluster of two nodes up in {ray_up:.1f} s (once per cluster, not per run)")
    print("\n| | local | ray | ray / local |\n|---|---|---|---|")
    for key, label in (("startup", "command → processes up (s)"), ("first_step", "first step (s)"),
                       ("per_step", "per step after the first (s)"), ("shutdown", "last step → exit (s)"),
                       ("total", "whole run (s)")):
        print(f"| {label} | {local[key]:.2f} | {ray[key]:.2f} | {ray[key] / local[key]:.2f}× |")


if __name__ == "__main__":
    main()
