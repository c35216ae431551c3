"""Chaos: kill -9 random processes of a run, over and over, and audit its ledger after.

Starts a small tiny_arith run with periodic checkpoints and `recover.retries`, then at random
moments kills a random live process of it (the controller, a trainer rank, a generation server, a
rollout or reward worker; never the launcher, which is the supervisor). When the run ends, the
ledger audit (`areal_flow/controller/ledger.py: audit`) must show every admitted prompt group
trained exactly once, or filtered, dropped or pending, and no trained group staler than η.

    python tools/chaos.py [--kills 50] [--steps 200] [--seed 0] [-- extra overrides]
    python tools/chaos.py --scale 20 [--steps 2000]   # elastic: random scale commands instead of kills

With `--scale N`, N random `python -m areal_flow.scale RUN_DIR generate=±1` commands (between 1 and 3
servers, on 4 devices: the trainer holds one, two while it has two ranks) and 2 trainer resizes
(`trainers=2` a third of the way, `trainers=1` two thirds) on one live run, then the same audit, the
seconds from each scale-up until the new server serves, from each scale-down until it is gone and
of each resize, the samples thrown away per removal, and the run's trained samples/s with 1 server
and then with 2.

Prints the audit, the restarts (of a process alone, or of the whole run from its checkpoint), the seconds from each kill to the next step trained, and the work lost
per kill (prompt groups generated and then thrown away, in samples); writes them as JSON with --out.
The test suite runs a short version (tests/test_chaos.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

from rich.console import Console
from rich.table import Table

SMALL = ["algorithm.batch_size=2", "algorithm.group_size=4", "rollout.max_concurrent=8", "dataset.n_train=400",
         "dataset.n_eval=16", "model.bootstrap_steps=30", "model.bootstrap_batch_size=32", "max_wall_seconds=0",
         "metrics.plot=false", "algorithm.success_rate_range=null", "eval_at_start=false", "eval_at_end=false",
         "launcher.start_timeout=90", "step_timeout=120"]
"""The test suite's small run (tests/run_helpers.py), without evaluations."""


def run_processes(run_dir: str) -> dict[str, int]:
    """Live processes the launcher started for this run (marked with AREAL_FLOW_RUN): name -> pid.
    A process's own children (a reward worker's scoring pool) carry its name too: the one whose
    parent has another name is the process itself."""
    marker = f"AREAL_FLOW_RUN={run_dir}".encode()
    named: dict[int, tuple[str, int]] = {}  # pid -> (name, parent pid)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read().rsplit(")", 1)[1].split()
            if marker in env and stat[0] != "Z":
                name = next(e for e in env if e.startswith(b"AREAL_FLOW_PROC=")).split(b"=", 1)[1].decode()
                named[int(pid)] = (name, int(stat[1]))
        except (OSError, StopIteration):
            continue
    return {name: pid for pid, (name, parent) in named.items() if named.get(parent, ("",))[0] != name}


def jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def chaos(run_dir: str, *, kills: int, steps: int, seed: int, every: tuple[float, float], overrides: list[str],
          timeout: float, console: Console) -> dict:
    """Run the chaos and return its figures (the audit included)."""
    from areal_flow.controller.ledger import audit

    rng = random.Random(seed)
    eta = next((int(o.split("=")[1]) for o in overrides if o.startswith("rollout.max_staleness=")), 2)
    cmd = [sys.executable, "-m", "areal_flow.launch", *SMALL, f"total_steps={steps}", "checkpoint.every_steps=2",
           f"recover.retries={kills}", f"rollout.max_staleness={eta}", f"hydra.run.dir={run_dir}", *overrides]
    os.makedirs(run_dir, exist_ok=True)
    log = open(os.path.join(run_dir, "launcher.out"), "w")
    launcher = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=os.path.dirname(run_dir))
    killed: list[tuple[float, str]] = []
    deadline = time.monotonic() + timeout
    try:
        while launcher.poll() is None and len(killed) < kills and time.monotonic() < deadline:
            time.sleep(rng.uniform(*every))
            alive = run_processes(run_dir)
            if not alive or not os.path.isdir(os.path.join(run_dir, "checkpoints")):
                continue  # starting up: let it save its first checkpoint
            name = rng.choice(sorted(alive))
            try:
                os.kill(alive[name], signal.SIGKILL)
            except ProcessLookupError:
                continue
            killed.append((time.time(), name))
            console.print(f"kill -9 {name} ({len(killed)}/{kills})", highlight=False)
        launcher.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGINT)
            launcher.wait(timeout=60)
        log.close()
    metrics = jsonl(os.path.join(run_dir, "metrics.jsonl"))
    result = audit(os.path.join(run_dir, "ledger.jsonl"), eta)
    discarded = jsonl(os.path.join(run_dir, "ledger.discarded.jsonl"))
    lost = sum(e["event"] in ("finish", "filter", "drop") for e in discarded)
    # Seconds from each kill to the first step the run trained after it (detection, the restart of
    # every process, the checkpoint's load, and the step itself).
    step_times = sorted(m["time"] for m in metrics if m["event"] == "step")
    to_step = [next(t for t in step_times if t > at) - at for at, _ in killed if any(t > at for t in step_times)]
    with open(os.path.join(run_dir, "launcher.out")) as f:
        out = f.read()
    restarts, alone = out.count("recover: restart"), out.count("restarted, the run goes on")
    group_size = 4
    return {"kills": len(killed), "killed": [n for _, n in killed], "launcher_exit": launcher.returncode,
            "steps": result["steps"], "audit": result, "eta": eta,
            "staleness_max": max((m["staleness_max"] for m in metrics if m["event"] == "step"), default=0),
            "restarts": restarts, "restarted_alone": alone, "kill_to_step_seconds": sorted(to_step),
            "lost_samples_per_kill": lost * group_size / max(1, len(killed)),
            "checkpoint_seconds": [m["seconds"] for m in metrics if m["event"] == "checkpoint"]}


SCALE_RUN = ["cluster.n_devices=4", "launcher.pin_cpus=false"]
"""Devices for up to 3 generation servers beside the trainer (unpinned: this machine may have fewer cores)."""


def samples_per_second(run_dir: str, since: float, until: float) -> float:
    """Trained samples/s over the step rows logged between two times."""
    metrics = jsonl(os.path.join(run_dir, "metrics.jsonl"))
    start = next(m for m in metrics if m["event"] == "start")
    rows = [m for m in metrics if m["event"] == "step" and since <= m["time"] <= until]
    if len(rows) < 2:
        return float("nan")
    return (len(rows) - 1) * start["batch_size"] * start["group_size"] / (rows[-1]["time"] - rows[0]["time"])


def scale(run_dir: str, change: str) -> dict:
    """One `python -m areal_flow.scale` command, as a user runs it: its outcome line."""
    out = subprocess.run([sys.executable, "-m", "areal_flow.scale", run_dir, change], capture_output=True, text=True)
    lines = [r for r in jsonl(os.path.join(run_dir, "scale", "results.jsonl")) if r["command"] == change]
    return {"exit": out.returncode, "said": out.stdout.strip(), **(lines[-1] if lines and out.returncode != 2 else {})}


def scale_chaos(run_dir: str, *, scales: int, steps: int, seed: int, overrides: list[str], timeout: float,
                window: float, console: Console) -> dict:
    """Random scale commands on one live run; its figures (the audit included)."""
    from areal_flow.controller.ledger import audit

    rng = random.Random(seed)
    eta = next((int(o.split("=")[1]) for o in overrides if o.startswith("rollout.max_staleness=")), 2)
    cmd = [sys.executable, "-m", "areal_flow.launch", *SMALL, *SCALE_RUN, f"total_steps={steps}",
           f"rollout.max_staleness={eta}", f"hydra.run.dir={run_dir}", *overrides]
    os.makedirs(run_dir, exist_ok=True)
    log = open(os.path.join(run_dir, "launcher.out"), "w")
    launcher = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=os.path.dirname(run_dir))
    done: list[dict] = []
    resized: list[dict] = []  # the trainer resizes among them
    throughput: dict[str, float] = {}
    deadline = time.monotonic() + timeout
    try:
        while launcher.poll() is None and not jsonl(os.path.join(run_dir, "metrics.jsonl")):
            time.sleep(0.5)
        # Throughput follows capacity: the same run with one server, then two.
        t0 = time.time()
        time.sleep(window)
        throughput["1 server"] = samples_per_second(run_dir, t0, time.time())
        done.append({"change": "generate=+1", **scale(run_dir, "generate=+1")})
        t0 = time.time()
        time.sleep(window)
        throughput["2 servers"] = samples_per_second(run_dir, t0, time.time())
        servers, trainers = 2, 1
        resizes = [(scales // 3, 2), (2 * scales // 3, 1)]  # (after that many server commands, trainers=N)
        while launcher.poll() is None and len(done) < scales + len(resized) and time.monotonic() < deadline:
            due = resizes and resizes[0][0] <= len(done) - len(resized)
            if due and servers + resizes[0][1] <= 4:  # a device for each rank (4 in all)
                change = f"trainers={resizes.pop(0)[1]}"
            elif due:
                change = "generate=-1"  # frees a device for the trainer's second rank
            else:
                most = 4 - trainers
                change = "generate=+1" if servers == 1 or (servers < most and rng.random() < 0.5) else "generate=-1"
            outcome = scale(run_dir, change)
            done.append({"change": change, **outcome})
            if change.startswith("trainers"):
                resized.append(done[-1])
                trainers = int(change.split("=")[1]) if outcome["exit"] == 0 else trainers
            else:
                servers += (1 if change.endswith("+1") else -1) if outcome["exit"] == 0 else 0
            console.print(f"{change} ({len(done)}/{scales + 2}): {outcome['said'].splitlines()[-1] if outcome['said'] else '?'}",
                          highlight=False)
            time.sleep(rng.uniform(0.5, 3.0))
        launcher.send_signal(signal.SIGINT)  # a checkpoint, then the summary
        launcher.wait(timeout=max(60.0, deadline - time.monotonic()))
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        log.close()
    result = audit(os.path.join(run_dir, "ledger.jsonl"), eta)
    metrics = jsonl(os.path.join(run_dir, "metrics.jsonl"))
    ups = [d for d in done if d["change"].endswith("+1") and d["exit"] == 0]
    downs = [d for d in done if d["change"].endswith("-1") and d["exit"] == 0]
    return {"scales": len(done), "ok": sum(d["exit"] == 0 for d in done), "launcher_exit": launcher.returncode,
            "resizes": [(d["change"], d.get("resize_seconds")) for d in resized if d["exit"] == 0],
            "steps": result["steps"], "audit": result, "eta": eta,
            "staleness_max": max((m["staleness_max"] for m in metrics if m["event"] == "step"), default=0),
            "up_to_serving_seconds": sorted(s for d in ups for s in d.get("serving_seconds", {}).values()),
            "down_seconds": sorted(d["seconds"] for d in downs),
            "lost_samples_per_removal": result["dropped"] * 4 / max(1, len(downs)),
            "throughput": throughput, "commands": done}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=50)
    ap.add_argument("--scale", type=int, default=0, help="N random scale commands instead of kills (elastic)")
    ap.add_argument("--window", type=float, default=20.0, help="--scale: seconds each throughput is measured over")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--every", type=float, nargs=2, default=(5.0, 20.0), help="seconds between kills: uniform in [a, b]")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds the whole chaos may take")
    ap.add_argument("--run-dir", default=None)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides of the run")
    args = ap.parse_args()
    console = Console()
    run_dir = os.path.abspath(args.run_dir or tempfile.mkdtemp(prefix="chaos-"))
    if args.scale:
        sys.exit(report_scale(run_dir, args, console))
    figures = chaos(run_dir, kills=args.kills, steps=args.steps, seed=args.seed, every=tuple(args.every),
                    overrides=args.overrides, timeout=args.timeout, console=console)
    audit = figures["audit"]
    table = Table(title=f"chaos: {figures['kills']} kills, run {run_dir}")
    table.add_column("what")
    table.add_column("value", justify="right")
    for what, value in [("launcher exit code", figures["launcher_exit"]), ("steps trained", figures["steps"]),
                        ("processes restarted alone", figures["restarted_alone"]),
                        ("restarts of the whole run", figures["restarts"]), ("groups admitted", audit["admitted"]),
                        ("trained", audit["trained"]), ("filtered", audit["filtered"]), ("dropped", audit["dropped"]),
                        ("pending at the end", audit["pending"]),
                        ("audit problems", len(audit["problems"])),
                        (f"trained tokens more than η = {figures['eta']} behind (ledger)", audit["stale_tokens"]),
                        (f"realised staleness, max (η = {figures['eta']})", figures["staleness_max"]),
                        ("kill to the next step, median s", _median(figures["kill_to_step_seconds"])),
                        ("samples thrown away per kill", f"{figures['lost_samples_per_kill']:.1f}"),
                        ("checkpoint, median s", _median(figures["checkpoint_seconds"]))]:
        table.add_row(what, str(value))
    console.print(table)
    for p in audit["problems"][:20]:
        console.print(f"[red]audit:[/] {p}", highlight=False)
    console.print("killed: " + ", ".join(figures["killed"]), highlight=False)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(figures, f, indent=1)
    sys.exit(0 if not audit["problems"] and figures["launcher_exit"] == 0 else 1)


def report_scale(run_dir: str, args: argparse.Namespace, console: Console) -> int:
    figures = scale_chaos(run_dir, scales=args.scale, steps=args.steps, seed=args.seed, overrides=args.overrides,
                          timeout=args.timeout, window=args.window, console=console)
    audit = figures["audit"]
    table = Table(title=f"elastic chaos: {figures['scales']} scale commands, run {run_dir}")
    table.add_column("what")
    table.add_column("value", justify="right")
    rates = figures["throughput"]
    for what, value in [("launcher exit code (130: stopped after the commands)", figures["launcher_exit"]),
                        ("scale commands carried out", f"{figures['ok']} of {figures['scales']}"),
                        ("steps trained", figures["steps"]), ("groups admitted", audit["admitted"]),
                        ("trained", audit["trained"]), ("dropped", audit["dropped"]), ("pending at the end", audit["pending"]),
                        ("scale events in the ledger", audit["scales"]), ("audit problems", len(audit["problems"])),
                        (f"realised staleness, max (η = {figures['eta']})", figures["staleness_max"]),
                        ("scale-up to serving, median s", _median(figures["up_to_serving_seconds"])),
                        ("scale-down to gone, median s", _median(figures["down_seconds"])),
                        ("samples thrown away per removal", f"{figures['lost_samples_per_removal']:.1f}"),
                        ("trainer resizes, s each", ", ".join(f"{c}: {s:.1f}" for c, s in figures["resizes"]) or "-"),
                        ("trained samples/s, 1 server", f"{rates.get('1 server', float('nan')):.1f}"),
                        ("trained samples/s, 2 servers", f"{rates.get('2 servers', float('nan')):.1f}")]:
        table.add_row(what, str(value))
    console.print(table)
    for p in audit["problems"][:20]:
        console.print(f"[red]audit:[/] {p}", highlight=False)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(figures, f, indent=1)
    return 0 if not audit["problems"] and figures["launcher_exit"] in (0, 130) else 1


def _median(values: list[float]) -> str:
    return f"{sorted(values)[len(values) // 2]:.2f}" if values else "-"


if __name__ == "__main__":
    main()
