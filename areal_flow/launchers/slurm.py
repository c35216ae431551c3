"""`launcher.type=slurm`: the run as one sbatch job of `cluster.n_nodes` nodes.

The launcher runs on a login node. It prepares what it can there (data, model, `config.yaml`, and
`spec.json` with the run's secret and every port), writes `RUN_DIR/job.sbatch` and submits it. Node
names are only known inside the job, so the script's first action is
`python -m areal_flow.launchers.slurm_job prepare`, which maps placement node k to the k-th host
of the allocation and writes each process's address into `spec.json`. Then one `srun` step per
process of the placement starts it on its node (a node's trainer ranks as one torchrun), and the
script watches the steps as the local launcher watches its children: when the controller finishes
the run is done; when any other step exits first, the others are stopped and the job fails with
that step's exit code.

The run directory (and `cache_dir`, where the data and bootstrapped model are) must be on a file
system every node mounts: the steps read the config and spec there and write their logs,
metrics and weights there.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass

from areal_flow.config.schema import RunConfig
from areal_flow.graph.mesh import format_mesh
from areal_flow.graph.placement import LISTENERS, Placement, Proc
from areal_flow.launchers.slurm_refusals import pending_forever, rejected


class SlurmError(RuntimeError):
    pass


@dataclass(frozen=True)
class Step:
    """One srun step of the job: a process of the placement, or a node's trainer ranks under torchrun."""

    name: str  # its log is logs/<name>.log
    node: int  # placement node = index into the job's host list
    devices: tuple[int, ...]  # as numbered on its node
    trainers: tuple[Proc, ...] = ()  # a torchrun step: the ranks it starts


def port_names(placement: Placement) -> list[str]:
    """The processes that listen, in the order the spec lists their ports, then the trainers'
    torch.distributed rendezvous ("dist"), which torchrun hosts on the first trainer node, then a
    critic's processes' on several devices ("<node>_dist", on its first process's node)."""
    listeners = [p.name for r in LISTENERS for p in placement.of_role(r)]
    return [*listeners, "controller", "dist", *(f"{n}_dist" for n in placement.rendezvous)]


def fixed_ports(placement: Placement, base_port: int) -> dict[str, int]:
    """A port for each name of `port_names`, counted up from `base_port`. Fixed, not probed: the
    login node cannot see which ports are free on nodes it has not been given yet, and the script's
    torchrun line needs the rendezvous port before the job starts."""
    return {name: base_port + i for i, name in enumerate(port_names(placement))}


def steps(placement: Placement) -> list[Step]:
    """The job's steps in start order: each process but the trainers on its own, then one torchrun
    per node holding trainer ranks."""
    out = [Step(p.name, p.node, p.local_devices) for p in placement.procs if p.role != "trainer"]
    by_node: dict[int, list[Proc]] = {}
    for p in placement.of_role("trainer"):
        by_node.setdefault(p.node, []).append(p)
    expected = 0
    for node in sorted(by_node):
        ranks = by_node[node]
        # torchrun gives ranks node by node (node_rank order, local ranks in order): the placement's
        # trainer ranks must be numbered the same way for each process to be the rank it is told.
        if [p.rank for p in ranks] != list(range(expected, expected + len(ranks))):
            raise SlurmError(f"trainer ranks {[p.rank for p in ranks]} on node {node} are not consecutive after rank "
                             f"{expected - 1}: torchrun could not number them as the placement does")
        expected += len(ranks)
        out.append(Step(f"trainers-node{node}", node, tuple(d for p in ranks for d in p.local_devices), tuple(ranks)))
    return out


def sbatch_head(cfg: RunConfig, run_dir: str) -> list[str]:
    """The script's #SBATCH lines."""
    lc, cluster = cfg.launcher, cfg.cluster
    head = ["#!/bin/bash", f"#SBATCH --job-name=areal_flow-{cfg.recipe or 'run'}", f"#SBATCH --nodes={cluster.n_nodes}",
            # One task per node holds the node's devices; the steps share them (srun --overlap below).
            "#SBATCH --ntasks-per-node=1"]
    if cluster.device_type == "cuda":
        head.append(f"#SBATCH --gpus-per-node={cluster.n_devices}")
    else:  # a device is a core: the job holds n_devices cores on each node
        head.append(f"#SBATCH --cpus-per-task={cluster.n_devices}")
    for flag, value in (("partition", lc.slurm_partition), ("account", lc.slurm_account), ("time", lc.slurm_time)):
        if value:
            head.append(f"#SBATCH --{flag}={value}")
    if lc.slurm_stop_before:
        # B: to the script alone, which asks the controller for a checkpoint and a clean stop (USR1 below).
        head.append(f"#SBATCH --signal=B:USR1@{lc.slurm_stop_before}")
    head += [f"#SBATCH {line.strip()}" for line in lc.slurm_extra]
    # sbatch reads these paths as they are written (no shell): launch.py refuses a run_dir with spaces.
    # --open-mode=append: a requeued job (a node failed) adds to its log, which says why it ended.
    return head + [f"#SBATCH --chdir={run_dir}", f"#SBATCH --output={run_dir}/logs/job-%j.log",
                   "#SBATCH --open-mode=append"]


PRELUDE = """
# Written by areal_flow (launcher.type=slurm); the run is described in config.yaml and spec.json here.
set -o pipefail  # not -u: bash before 4.4 calls an empty array unbound
RUN_DIR={run_dir}
STOP_TIMEOUT={stop_timeout}
TIME_SETTING={time_setting}
# The allocation's hosts in Slurm's order: placement node k runs on HOSTS[k].
mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
if (( ${{#HOSTS[@]}} < {n_nodes} )); then
  echo "areal_flow: the job has ${{#HOSTS[@]}} nodes, the placement needs {n_nodes}" >&2; exit 1
fi
# Completes spec.json with each process's address (hostnames are only known now); ports are fixed.
# ADDRS[k]: the address of placement node k (Slurm's NodeAddr, or what its name resolves to).
ADDRS_TEXT=$({job} prepare "$RUN_DIR" "${{HOSTS[@]}}") || exit 1
mapfile -t ADDRS <<< "$ADDRS_TEXT"

declare -A PIDS=() NODE=()
# One step per process, one task on one node. --overlap: the steps share the job's CPUs and memory
# (a step otherwise takes all of a node's and blocks the next); each process gets its own devices
# from the placement (slurm_job step --devices), as under the local launcher.
start() {{
  local name=$1 node=$2; shift 2
  srun --overlap --nodes=1 --ntasks=1 --nodelist="${{HOSTS[$node]}}" --open-mode=append \\
       --output="$RUN_DIR/logs/$name.log" "$@" &
  PIDS[$name]=$!
  NODE[$name]=$node
}}

# Placement node K as a reader finds it: its host, its address, and Slurm's state of it where the
# node is not up (down, drained, failing or not responding).
where() {{
  local state
  state=$(scontrol show node "${{HOSTS[$1]}}" --oneliner 2>/dev/null | grep -o 'State=[^ ]*')
  case ${{state#State=}} in
    *DOWN*|*DRAIN*|*FAIL*|*'*') state=", which Slurm reports ${{state#State=}}";;
    *) state="";;
  esac
  echo "node $1 (${{HOSTS[$1]}}, ${{ADDRS[$1]}}$state)"
}}

# Stop every step still running: SIGTERM to their tasks (scancel signals the steps, not this script;
# srun itself would answer a SIGTERM with SIGKILL), SIGKILL after STOP_TIMEOUT.
stop_steps() {{
  if [[ -z $SLURM_JOB_ID ]] || ! scancel --signal=TERM "$SLURM_JOB_ID" 2>/dev/null; then
    for pid in "${{PIDS[@]}}"; do kill -TERM "$pid" 2>/dev/null; done
  fi
  local deadline=$(( SECONDS + STOP_TIMEOUT ))
  while (( SECONDS < deadline )) && [[ -n $(jobs -pr) ]]; do sleep 1; done
  for pid in "${{PIDS[@]}}"; do kill -KILL "$pid" 2>/dev/null; done
}}

# SIGUSR1 (Slurm before the time limit, --signal; or `scancel --batch --signal=USR1 JOB`): the
# controller stops the run after its current step, with a checkpoint that resume=auto continues.
# The watch loop passes it on every few seconds until the controller ends: a controller still
# starting ignores it (each step starts with SIGUSR1 ignored) until it can act on it.
STOPPING=0
time_left() {{ [[ -n $SLURM_JOB_ID ]] && squeue --noheader --jobs="$SLURM_JOB_ID" --format=%L 2>/dev/null; }}
trap '(( STOPPING )) || echo "areal_flow: SIGUSR1 (Slurm before the time limit, $TIME_SETTING, $(time_left) left; or scancel --signal=USR1): the run stops after its current step, with a checkpoint; resume=auto continues it" >&2
      STOPPING=1' USR1
# SIGTERM (scancel, a time limit without the signal, a node that failed): every step stops now; the
# run directory keeps its last complete checkpoint.
trap 'echo "areal_flow: the job was cancelled (scancel, its time limit $TIME_SETTING, or a node that failed); the last complete checkpoint resumes it" >&2
      for k in "${{!HOSTS[@]}}"; do echo "areal_flow:   $(where "$k")" >&2; done
      stop_steps; exit 143' TERM
"""

WATCH = """
# Watch the steps: the controller exiting 0 ends the run; any other step exiting first fails it.
status=0
nudged=-5
while (( status == 0 )); do
  if (( STOPPING && SECONDS >= nudged + 5 )); then
    kill -USR1 "${PIDS[controller]}" 2>/dev/null
    nudged=$SECONDS
  fi
  for name in "${!PIDS[@]}"; do
    pid=${PIDS[$name]}
    kill -0 "$pid" 2>/dev/null && continue
    wait "$pid"; code=$?
    unset "PIDS[$name]"
    if [[ $name == controller && $code == 0 ]]; then status=-1; break; fi
    echo "areal_flow: process '$name' on $(where "${NODE[$name]}") exited with code $code; its log is $RUN_DIR/logs/$name.log" >&2
    status=$(( code == 0 ? 1 : code )); break
  done
  (( status == 0 )) && sleep 1
done
# A run stopped on SIGUSR1 ends with 130, as the local launcher's; one that finished, 0.
(( status < 0 )) && status=$(( STOPPING ? 130 : 0 ))
# The job then ends and frees its nodes.
stop_steps
exit "$status"
"""


def sbatch_script(cfg: RunConfig, placement: Placement, run_dir: str, python: str = sys.executable) -> str:
    """The job script of a run whose config and spec are (or will be) in `run_dir`."""
    cluster = cfg.cluster
    ports = fixed_ports(placement, cfg.launcher.slurm_base_port)
    q = shlex.quote
    job = f"{q(python)} -m areal_flow.launchers.slurm_job"
    body = [PRELUDE.format(run_dir=q(run_dir), stop_timeout=int(cfg.launcher.stop_timeout), n_nodes=cluster.n_nodes,
                           job=job, time_setting=q(f"launcher.slurm_time={cfg.launcher.slurm_time or 'null'}"))]
    trainer_nodes = sorted({s.node for s in steps(placement) if s.trainers})
    unit = "gpus" if cluster.device_type == "cuda" else "cores"
    for s in steps(placement):
        devices = f" --devices {format_mesh(s.devices)}" if s.devices else ""
        where = f"node {s.node}, {unit} {format_mesh(s.devices)}" if s.devices else f"node {s.node}, light"
        line = f'start {s.name} {s.node} {job} step "$RUN_DIR" {s.name}{devices}'
        if s.trainers:
            ranks = f"{s.trainers[0].rank}-{s.trainers[-1].rank}"
            body.append(f"# trainer ranks {ranks} ({where}): one torchrun, rendezvous on the first trainer node")
            line += (f" -- \\\n    {q(python)} -m torch.distributed.run --nnodes={len(trainer_nodes)} "
                     f"--node_rank={trainer_nodes.index(s.node)} --nproc_per_node={len(s.trainers)} "
                     f'--master_addr="${{ADDRS[{trainer_nodes[0]}]}}" --master_port={ports["dist"]} \\\n'
                     f'    -m areal_flow.runtime.child trainer trainer {s.trainers[0].rank} "$RUN_DIR"')
        else:
            body.append(f"# {s.name} ({where})")
        body.append(line)
    return "\n".join(sbatch_head(cfg, run_dir) + body) + WATCH


def sbatch_missing() -> str | None:
    if shutil.which("sbatch") is None:
        return ("launcher.type=slurm submits the run with sbatch, which is not on PATH: run on a Slurm login node "
                "(or use launcher.type=local/ray; dry_run=true prints the script without it)")
    return None


def submit(script_path: str, cfg: RunConfig) -> str:
    """Submit the script; the job id. SlurmError, one line naming the setting, when Slurm refuses
    the job or accepts it only to pend forever (slurm_refusals.py)."""
    r = subprocess.run(["sbatch", "--parsable", script_path], capture_output=True, text=True)
    if r.returncode != 0:
        raise SlurmError(rejected(cfg, r.stderr or r.stdout))
    job_id = r.stdout.strip().split(";")[0]  # --parsable prints "jobid[;cluster]"
    if problem := pending_forever(cfg, job_id):
        raise SlurmError(problem)
    return job_id
