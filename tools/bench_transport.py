"""Sample transport between two processes, and each process's traffic per step of a run.

1. Throughput: a sender process pushes scored groups of 512-answer-token samples (ids, behaviour
   logprobs, versions, and a 64-token prompt) over ZeroMQ to a receiver process that decodes every
   message, as a trainer rank's inbox does. The same samples as pickled dicts of numpy arrays over
   the same sockets are the comparison. Prints samples/s and MB/s for both and the ratio. With
   `--secure`, also msgspec over CURVE sockets with a run's keys (what a secured run pays).
2. With `--run DIR` (a finished run directory): the median bytes each process sent per step, and
   the controller's CPU time per step as a fraction of the step, from DIR/metrics.jsonl.

    python tools/bench_transport.py [--samples 200000] [--group 8] [--secure] [--run outputs/tiny_arith/<time>]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import pickle
import statistics
import time

import numpy as np
import zmq

from _bench import machine
from areal_flow.metrics.writer import read_metrics
from areal_flow.runtime.security import Security
from areal_flow.runtime.ports import free_ports
from areal_flow.transport.channels import endpoint, make_socket
from areal_flow.transport.messages import Array, Sample, ScoredGroup, decode, encode

PROMPT, ANSWER = 64, 512


def make_group(group_id: int, size: int) -> ScoredGroup:
    rng = np.random.default_rng(group_id)
    return ScoredGroup(group_id, [
        Sample(uid=f"g{group_id}-{i}", prompt_id=str(group_id), group_id=group_id, index=i, birth_time=0.0,
               fields={"prompt": "1+2=", "answer": "3"},
               arrays={"prompt_ids": Array.of(rng.integers(0, 32000, PROMPT, dtype=np.int32)),
                       "output_ids": Array.of(rng.integers(0, 32000, ANSWER, dtype=np.int32)),
                       "behav_logprobs": Array.of(rng.standard_normal(ANSWER).astype(np.float32)),
                       "versions": Array.of(np.zeros(ANSWER, dtype=np.int32))},
               scalars={"rewards": 1.0})
        for i in range(size)])


def as_pickle(group: ScoredGroup) -> bytes:
    return pickle.dumps([{"uid": s.uid, "scalars": s.scalars, "fields": s.fields,
                          **{k: s.array(k) for k in s.arrays}} for s in group.samples], protocol=5)


def sender(port: int, n_messages: int, size: int, kind: str, security: Security | None) -> None:
    sock = make_socket(zmq.Context(), zmq.PUSH, connect=endpoint(port), security=security)
    frames = [as_pickle(make_group(g, size)) if kind == "pickle" else encode(make_group(g, size)) for g in range(16)]
    for i in range(n_messages):
        sock.send(frames[i % len(frames)], copy=False)
    sock.close(linger=-1)


def measure(n_samples: int, size: int, kind: str) -> tuple[float, float]:
    """(samples/s, MB/s) received and decoded, timed from the first message to the last."""
    port = free_ports(1)[0]
    security = Security.new() if kind == "msgspec, CURVE" else None
    sock = make_socket(zmq.Context(), zmq.PULL, bind=endpoint(port), security=security)
    n_messages = n_samples // size
    proc = mp.get_context("spawn").Process(target=sender, args=(port, n_messages, size, kind, security))
    proc.start()
    load = pickle.loads if kind == "pickle" else decode
    first = sock.recv(copy=False)
    t0, nbytes = time.perf_counter(), len(first)
    load(first.buffer)
    for _ in range(n_messages - 1):
        frame = sock.recv(copy=False)
        nbytes += len(frame)
        load(frame.buffer)
    seconds = time.perf_counter() - t0
    proc.join()
    sock.close()
    return (n_messages - 1) * size / seconds, nbytes / seconds / 1e6


def run_steps(run_dir: str) -> list[dict]:
    """The run's step records, the first left out (it includes start-up)."""
    return [m for m in read_metrics(f"{run_dir}/metrics.jsonl") if m["event"] == "step"][1:]


def run_traffic(run_dir: str) -> None:
    steps = run_steps(run_dir)
    procs = sorted({k.split("/", 1)[1] for m in steps for k in m if k.startswith("sent_bytes/")})
    print(f"\nper-step traffic of {run_dir} ({len(steps)} steps, the first left out)")
    print("| process | median bytes sent per step |\n|---|---|")
    for p in procs:
        print(f"| {p} | {statistics.median(m.get(f'sent_bytes/{p}', 0) for m in steps):,.0f} |")
    cpu = sorted(m["controller_cpu_fraction"] for m in steps)
    median = statistics.median(cpu)
    print(f"controller CPU time per step: median {100 * median:.2f}% of the step, "
          f"90th percentile {100 * cpu[int(0.9 * (len(cpu) - 1))]:.2f}%, max {100 * cpu[-1]:.2f}%; "
          f"target < 1%: {'met' if median < 0.01 else 'NOT met'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=200_000)
    ap.add_argument("--group", type=int, default=8, help="samples per message (a prompt group)")
    ap.add_argument("--secure", action="store_true", help="also measure msgspec over CURVE (a secured run's sockets)")
    ap.add_argument("--run", help="a finished run directory: report its per-step traffic")
    args = ap.parse_args()
    if args.run and len(run_steps(args.run)) < 1:
        ap.error(f"--run {args.run}: {args.run}/metrics.jsonl has fewer than 2 steps (an unfinished or failed run?)")
    print(f"machine: {machine()}")
    print(f"command: python tools/bench_transport.py --samples {args.samples} --group {args.group}"
          + (" --secure" if args.secure else ""))
    kinds = ("msgspec", "pickle") + (("msgspec, CURVE",) if args.secure else ())
    rows = {kind: measure(args.samples, args.group, kind) for kind in kinds}
    print(f"\n{ANSWER}-token samples (+{PROMPT}-token prompt), {args.group} per message, two processes, loopback TCP")
    print("| wire format | samples/s | MB/s |\n|---|---|---|")
    for kind, (sps, mbs) in rows.items():
        print(f"| {kind} | {sps:,.0f} | {mbs:,.0f} |")
    print(f"msgspec / pickle: {rows['msgspec'][0] / rows['pickle'][0]:.2f}x samples/s; target ≥ 50,000 samples/s: "
          f"{'met' if rows['msgspec'][0] >= 50_000 else 'NOT met'}")
    if args.secure:
        print(f"CURVE / plain: {rows['msgspec, CURVE'][0] / rows['msgspec'][0]:.2f}x samples/s")
    if args.run:
        run_traffic(args.run)


if __name__ == "__main__":
    main()
