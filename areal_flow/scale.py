"""`python -m areal_flow.scale RUN_DIR generate=+2` (or `generate=-1`, `generate=4`): add or remove
the policy's generation servers of a live run, losing and repeating nothing; `judge=+1` a judge's;
`trainers=N`: go on with N trainer ranks (docs/reliability.md, "Elastic"). The run's launcher carries it out (launchers/elastic.py); this command checks what it
can, hands the request over, and waits for the outcome.

Exit 0: done; 1: done in part (a new server failed to start, reported and left out); 2: refused,
the run unchanged (a run that is not running, a role that does not exist, a size below 1 or beyond
the free devices, another scale in progress, a trainer that cannot change its size).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from rich.console import Console

from areal_flow.generation.client.membership import read_membership, servers_file
from areal_flow.launchers.elastic import ScaleRefused, judge_of, parse_change, results, running, submit, target_size
from areal_flow.runtime import run_dir as rd
from areal_flow.runtime.spec import read_spec


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m areal_flow.scale", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", metavar="RUN_DIR", help="the live run's directory (hydra.run.dir)")
    p.add_argument("change", metavar="ROLE=SIZE", help="generate=+N, -N or N; trainers=N; judge=+N, -N or N "
                   "(judge:<node>=... with several judges)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for the launcher (default 900)")
    return p.parse_args(argv)


def request(run_dir: str, change: str) -> str:
    """Check the command and hand it to the launcher: its request id. ScaleRefused, run unchanged."""
    if not os.path.isfile(os.path.join(run_dir, rd.SPEC)):
        raise ScaleRefused(f"{run_dir} is not a run directory (it has no spec.json)")
    if not running(run_dir):
        raise ScaleRefused(f"the run in {run_dir} is not running (no launcher holds it): scale a live run, or "
                           "resume it with the sizes you want")
    role, sep, size = change.partition("=")
    if not sep:
        raise ScaleRefused(f"{change!r}: write ROLE=SIZE, e.g. generate=+2")
    parse_change(role, size)
    spec = read_spec(run_dir)
    judge = judge_of(role, list(spec.judge_ports))
    if role == "trainers":
        now = spec.n_trainers
    elif (membership := read_membership(run_dir, judge)) is None:
        raise ScaleRefused(f"the run in {run_dir} has no {servers_file(judge)}: it was started by an older areal_flow")
    else:
        now = len(membership.serving())
    target_size(role, size, now)  # the launcher checks again, against the devices
    return submit(run_dir, role, size).id


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    console = Console(highlight=False, soft_wrap=True)  # a message on one line, for logs and greps
    try:
        rid = request(args.run_dir, args.change)
    except ScaleRefused as e:
        console.print(f"[bold red]refused:[/] {e}")
        return 2
    deadline = time.monotonic() + args.timeout
    with console.status(f"{args.change}: the launcher is carrying it out ..."):
        while (out := next((r for r in results(args.run_dir) if r["id"] == rid), None)) is None:
            if not running(args.run_dir):
                console.print("[bold red]the run ended[/] before its launcher carried the command out")
                return 1
            if time.monotonic() > deadline:
                console.print(f"[bold red]no outcome within {args.timeout:g} s[/]: the request is still pending "
                              f"({args.run_dir}/scale/request.json)")
                return 1
            time.sleep(0.2)
    if out.get("refused"):
        console.print(f"[bold red]refused:[/] {out['message']}")
        return 2
    for name in out.get("added", []):
        console.print(f"added {name}: healthy after {out['healthy_seconds'][name]:.1f} s, serving the newest "
                      f"weights after {out['serving_seconds'].get(name, float('nan')):.1f} s")
    for name, why in out.get("failed", {}).items():
        console.print(f"[bold red]{name} failed to start[/]: {why}; it was removed, the run goes on")
    if trainers := out.get("trainers"):
        console.print(f"trainer ranks {trainers['from']} -> {trainers['to']}: checkpoint of step {out['step']} "
                      f"({out['checkpoint']}), the new ranks training from it after {out['resize_seconds']:.1f} s; "
                      "generation went on meanwhile")
    if out.get("removed"):
        console.print(f"removed {', '.join(out['removed'])}: drained (its running requests went on elsewhere) "
                      "and stopped")
    console.print(f"done in {out['seconds']:.1f} s")
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
