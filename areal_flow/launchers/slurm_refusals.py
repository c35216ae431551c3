"""What Slurm says no to, said as the setting to change (launcher.type=slurm).

Slurm refuses a job in two ways: sbatch rejects it at once (a partition that does not exist, a
node shape no partition has), or it accepts it and the job pends for a reason that waiting will
not clear (more nodes or a longer time than the partition allows: clusters without
`EnforcePartLimits`). Both end as one line naming the run's setting; a job pending forever is
cancelled first, so it does not sit in the queue."""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Callable

from areal_flow.config.schema import RunConfig


Setting = Callable[[RunConfig], str]


def _key(key: str, unset: str = "null") -> Setting:
    """A setting said as `key=value` (e.g. launcher.slurm_time=4:00:00)."""
    section, name = key.split(".")
    return lambda cfg: f"{key}={getattr(getattr(cfg, section), name) or unset}"


_partition = _key("launcher.slurm_partition", "null (the default partition)")
_time = _key("launcher.slurm_time", "null (the partition default)")
_nodes = _key("cluster.n_nodes")
_account = _key("launcher.slurm_account")


def _devices(cfg: RunConfig) -> str:
    unit = "GPUs" if cfg.cluster.device_type == "cuda" else "CPUs"
    return f"cluster.n_devices={cfg.cluster.n_devices} ({unit} a node, cluster.device_type={cfg.cluster.device_type})"


def _shape(cfg: RunConfig) -> str:
    return f"{_nodes(cfg)} and {_devices(cfg)}"


def _extra(cfg: RunConfig) -> str:
    return f"launcher.slurm_extra={list(cfg.launcher.slurm_extra)}"


# What sbatch prints when it rejects a job (lower case), and the settings it is about.
REJECTED: list[tuple[str, str, Setting]] = [
    ("invalid partition", "the partition does not exist", _partition),
    ("invalid --time", "the time limit is not one sbatch reads ('4:00:00', '2-00:00:00', minutes)", _time),
    ("time limit is invalid", "the time limit exceeds what the partition allows", _time),
    ("node count specification invalid", "the partition has fewer nodes", _nodes),
    ("requested node configuration is not available", "no nodes of the partition have that many devices", _shape),
    ("invalid generic resource", "the partition's nodes have no GPUs Slurm knows of (gres)", _devices),
    ("more processors requested than permitted", "more CPUs than the partition's nodes have", _devices),
    ("invalid account", "the account is not one you may charge", _account),
    ("invalid qos", "the QOS does not exist or is not yours", _extra),
    ("invalid feature", "no node has the feature asked for", _extra),
    ("memory specification can not be satisfied", "no node has the memory asked for", _extra),
]

# Reasons a job pends for that waiting does not clear (squeue's REASON), and the settings they are about.
PENDING_FOREVER: dict[str, tuple[str, Setting]] = {
    "PartitionNodeLimit": ("more nodes than the partition allows or has", _nodes),
    "PartitionTimeLimit": ("a longer time limit than the partition allows", _time),
    "PartitionConfig": ("nodes the partition does not have (devices a node, or nodes)", _shape),
    "BadConstraints": ("constraints no node meets", _extra),
    "InvalidAccount": ("an account it may not charge", _account),
    "AccountNotAllowed": ("an account the partition does not allow", _account),
    "InvalidQOS": ("a QOS that does not exist or is not yours", _extra),
    "QOSNotAllowed": ("a QOS the partition does not allow", _extra),
}


def rejected(cfg: RunConfig, sbatch_error: str) -> str:
    """One line for sbatch's rejection: what Slurm said, the setting to change."""
    said = " ".join(line.removeprefix("sbatch: error: ").strip() for line in sbatch_error.strip().splitlines())
    for pattern, meaning, setting in REJECTED:
        if pattern in said.lower():
            return f"Slurm refused the job ({said}): {meaning}: {setting(cfg)}"
    return f"Slurm refused the job ({said or 'sbatch failed'}): check launcher.slurm_* and cluster.* (docs/clusters.md)"


def job_fields(job_id: str) -> dict[str, str]:
    """`scontrol show job` as a dict (JobState, Reason, Partition, ...); empty where it cannot say."""
    try:
        r = subprocess.run(["scontrol", "show", "job", job_id, "--oneliner"], capture_output=True, text=True,
                           timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return dict(re.findall(r"(\w+)=(\S*)", r.stdout)) if r.returncode == 0 else {}


def pending_forever(cfg: RunConfig, job_id: str, settle: float = 3.0) -> str | None:
    """One line when job `job_id` pends for a reason waiting will not clear, after cancelling it;
    None when it runs, waits its turn, or Slurm cannot say. Slurm sets such reasons at
    submission, first the general PartitionConfig, then, after a pass of its scheduler, the
    particular one (PartitionTimeLimit, ...): up to `settle` seconds are given to that pass."""
    deadline = time.monotonic() + settle
    while True:
        job = job_fields(job_id)
        reason = job.get("Reason", "")
        if job.get("JobState") != "PENDING" or reason not in ("", "None", "PartitionConfig") \
                or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if job.get("JobState") != "PENDING" or reason not in PENDING_FOREVER:
        return None
    subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
    meaning, setting = PENDING_FOREVER[reason]
    return (f"Slurm will not run job {job_id} (pending: {reason}, cancelled): it asks partition "
            f"{job.get('Partition', '?')} for {meaning}: {setting(cfg)}")
