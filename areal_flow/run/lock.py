"""One launcher per run directory: two launches into one directory would interleave their ledger
and metrics. The launcher holds an flock on RUN_DIR/launcher.lock for its whole life; the kernel
drops it when the process ends, however it ends, so a dead run's directory is taken over. Whether
the holder lives is the lock's answer, never a pid test, which a reused pid would fool: the pid
written in the file only names the holder in the error.

Under `launcher.type=slurm` the launcher leaves once the job is submitted, and the job may run on
other hosts: the directory keeps the job's id (RUN_DIR/slurm_job), and a later launch into it asks
Slurm (`scontrol show job`) whether that job is still queued or running, and refuses if it is.
Where Slurm cannot say (no scontrol here, a job it no longer knows), the launch goes on."""

from __future__ import annotations

import fcntl
import os
import shutil

from areal_flow.runtime.disk import write_atomic
from areal_flow.runtime.run_dir import LOCK as LOCK_FILE
from areal_flow.runtime.run_dir import SLURM_JOB

_held: dict[str, int] = {}  # the run directories this launcher holds -> the lock file's descriptor


class RunDirBusy(Exception):
    """The run directory is held by a live launcher."""


LIVE_JOB_STATES = ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
                   "RESIZING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT", "RESV_DEL_HOLD")
"""Slurm's job states in which a job may still write its run directory."""


def hold_run_dir(run_dir: str, what: str) -> None:
    """Lock `run_dir` for this process's life, or raise RunDirBusy naming the holder (a launcher's
    pid, or the Slurm job running the directory); `what` names the key that chose the directory,
    e.g. `hydra.run.dir=/runs/a`."""
    path = os.path.realpath(run_dir)
    if path in _held:
        return
    if job := live_slurm_job(path):
        raise RunDirBusy(f"{what} is in use by Slurm job {job[0]} ({job[1]}): scancel {job[0]} or wait for it "
                         "to end, or choose another run directory")
    os.makedirs(path, exist_ok=True)
    fd = os.open(os.path.join(path, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by children
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RunDirBusy(f"{what} is in use by a live run (launcher pid {holder}): wait for it to end or stop it, "
                         "or choose another run directory") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _held[path] = fd


def note_slurm_job(run_dir: str, job_id: str) -> None:
    """Keep the id of the Slurm job now running `run_dir`, for `live_slurm_job`."""
    write_atomic(os.path.join(run_dir, SLURM_JOB), f"{job_id}\n".encode())


def live_slurm_job(run_dir: str) -> tuple[str, str] | None:
    """(job id, state) of the Slurm job noted for `run_dir` while Slurm says it is queued or
    running; None when none is noted, it has ended, or Slurm cannot say."""
    try:
        with open(os.path.join(run_dir, SLURM_JOB)) as f:
            job_id = f.read().strip()
    except FileNotFoundError:
        return None
    if not job_id or shutil.which("scontrol") is None:
        return None
    from areal_flow.launchers.slurm_refusals import job_fields  # (only where a Slurm job was noted)

    state = job_fields(job_id).get("JobState", "")
    return (job_id, state) if state in LIVE_JOB_STATES else None
