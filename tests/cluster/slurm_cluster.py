"""A real Slurm on this machine for the tests (docs/clusters.md, "A small Slurm cluster"): munge,
slurmctld, and one slurmd per host of a `Hosts`, each in its host's network namespace, so that the
job's steps on node k run at node k's address. Debian's slurm-wlm and munge are installed with apt
where they are missing. Everything lives under one directory (config, state, logs, munge's key
and socket): nothing of the machine's own /etc is read or changed."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

from netns_hosts import Hosts

from areal_flow.runtime.ports import free_ports

PROGRAMS = ("slurmctld", "slurmd", "sbatch", "munged")


def install() -> None:
    """apt-get install slurm-wlm and munge where their programs are missing (CI's fresh machine)."""
    if all(shutil.which(p) for p in PROGRAMS):
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, capture_output=True, env=env, timeout=600)
    subprocess.run(["apt-get", "install", "-y", "-qq", "slurm-wlm", "munge"], check=True, capture_output=True,
                   env=env, timeout=900)


CONF = """\
ClusterName=areal
SlurmctldHost={controller}({gateway})
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
AuthInfo=socket={root}/munge/socket
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/ctld
SlurmctldPidFile={root}/ctld/pid
SlurmctldLogFile={root}/ctld/log
SlurmdSpoolDir={root}/%n
SlurmdPidFile={root}/%n/pid
SlurmdLogFile={root}/%n/log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
ReturnToService=2
SlurmdTimeout=10
KillWait=10
MinJobAge=600
{nodes}
PartitionName=cpu Nodes=ALL Default=YES MaxTime={max_time} State=UP
"""


class SlurmCluster:
    """slurmctld in this machine's namespace (at the hosts' gateway address), node `n{k+1}` a
    slurmd in host k's namespace with `cpus` CPUs."""

    def __init__(self, root: Path, hosts: Hosts, cpus: int = 2, max_time: str = "30"):
        self.root, self.hosts, self.cpus = root, hosts, cpus
        self.nodes = [f"n{k + 1}" for k in range(hosts.n)]
        self.conf = root / "slurm.conf"
        self.ctld_port, self.slurmd_port = free_ports(2)
        self.max_time = max_time
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self) -> SlurmCluster:
        for d in ("munge", "ctld", *self.nodes):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        key = self.root / "munge" / "key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        m = self.root / "munge"
        # --force: munged runs as root here, with its own key, socket and files.
        subprocess.run(["munged", "--force", f"--key-file={key}", f"--socket={m}/socket", f"--pid-file={m}/pid",
                        f"--log-file={m}/log", f"--seed-file={m}/seed"], check=True, timeout=30)
        nodes = "\n".join(f"NodeName={name} NodeHostname=localhost NodeAddr={address} CPUs={self.cpus} State=UNKNOWN"
                          for name, address in zip(self.nodes, self.hosts.addresses))
        self.conf.write_text(CONF.format(controller=socket.gethostname().split(".")[0], gateway=self.hosts.gateway,
                                         ctld_port=self.ctld_port, slurmd_port=self.slurmd_port, root=self.root,
                                         nodes=nodes, max_time=self.max_time))
        subprocess.run(["slurmctld", "-f", str(self.conf)], check=True, env=self.env, timeout=30)
        for k in range(self.hosts.n):
            self.start_node(k)
        self.wait_nodes("idle")
        return self

    def start_node(self, k: int) -> None:
        subprocess.run(self.hosts.command(k, ["slurmd", "-f", str(self.conf), "-N", self.nodes[k]]), check=True,
                       env=self.env, timeout=30)

    def command(self, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), capture_output=True, text=True, env=self.env, timeout=timeout)

    def node_states(self) -> dict[str, str]:
        out = self.command("sinfo", "--noheader", "--Node", "--format=%N %T").stdout
        return dict(line.split() for line in out.splitlines() if line.strip())

    def wait_nodes(self, state: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while (states := self.node_states()) != {n: state for n in self.nodes}:
            if time.monotonic() > deadline:
                raise TimeoutError(f"Slurm's nodes are {states}, not all {state}; logs in {self.root}")
            time.sleep(0.5)

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, ExitCode, Reason, NodeList, ...)."""
        out = self.command("scontrol", "show", "job", job_id, "--oneliner").stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait_job(self, job_id: str, timeout: float = 300, until=lambda job: False) -> dict[str, str]:
        """Until job `job_id` has ended (or `until(job)` holds): its last `job`."""
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if until(job) or job.get("JobState") in ENDED:
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} is still {job.get('JobState')} after {timeout} s")
            time.sleep(0.5)

    def stop(self) -> None:
        self.command("scancel", "--user=root", "--full")
        for k in range(self.hosts.n):
            self.hosts.kill(k)  # the slurmd, their steps and the jobs' processes
        for pidfile in (self.root / "ctld" / "pid", self.root / "munge" / "pid"):
            try:
                os.kill(int(pidfile.read_text()), 9)
            except (OSError, ValueError):
                pass


ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE"}
