"""One launcher per run directory: a live run's directory is refused naming its pid, a dead run's
is taken over (areal_flow/run/lock.py)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from areal_flow.run import lock


def hold_in_another_process(run_dir: Path) -> subprocess.Popen:
    """A live holder of `run_dir`'s lock, as a launcher holds it, until it is killed."""
    code = ("import sys, time; from areal_flow.run.lock import hold_run_dir; "
            f"hold_run_dir({str(run_dir)!r}, 'x'); print('held', flush=True); time.sleep(120)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    return holder


def test_a_live_holder_is_named_by_pid_and_a_dead_ones_directory_is_taken_over(tmp_path):
    run_dir = tmp_path / "run"
    holder = hold_in_another_process(run_dir)
    try:
        with pytest.raises(lock.RunDirBusy, match=rf"^hydra.run.dir=R is in use by a live run \(launcher pid "
                                                  rf"{holder.pid}\): wait for it to end"):
            lock.hold_run_dir(str(run_dir), "hydra.run.dir=R")
    finally:
        holder.kill()  # as kill -9 would: the lock goes with the process, its pid stays in the file
        holder.wait()
    assert (run_dir / lock.LOCK_FILE).read_text() == f"{holder.pid}\n"
    lock.hold_run_dir(str(run_dir), "hydra.run.dir=R")
    try:
        assert (run_dir / lock.LOCK_FILE).read_text() == f"{os.getpid()}\n"
    finally:
        os.close(lock._held.pop(os.path.realpath(run_dir)))


def launch(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    # A jsonl dataset that does not exist: a launch that got past the lock stops at the data, before any process.
    return subprocess.run([sys.executable, "-m", "areal_flow.launch", f"hydra.run.dir={run_dir}", "dataset.name=jsonl",
                           f"dataset.train_path={run_dir.parent}/none.jsonl", f"dataset.eval_path={run_dir.parent}/none.jsonl",
                           *args], cwd=run_dir.parent, capture_output=True, text=True, timeout=120)


@pytest.mark.slow  # three launchers
def test_a_launch_and_a_resume_into_a_live_runs_directory_are_refused_in_one_line(tmp_path):
    run_dir = tmp_path / "run"
    holder = hold_in_another_process(run_dir)
    try:
        for extra, head in (((), ""), (("resume=auto",), "resume=auto: ")):
            r = launch(run_dir, *extra)
            assert r.returncode == 2, r.stdout + r.stderr
            assert r.stdout.strip() == f"error: {head}hydra.run.dir={run_dir} is in use by a live run (launcher pid " \
                                       f"{holder.pid}): wait for it to end or stop it, or choose another run directory"
    finally:
        holder.kill()
        holder.wait()
    r = launch(run_dir)
    assert r.returncode == 2 and "dataset file does not exist" in r.stdout, r.stdout + r.stderr
    assert (run_dir / lock.LOCK_FILE).read_text() != f"{holder.pid}\n"  # the new launcher took the directory


@pytest.mark.slow  # a real run, and two launchers into its directory while it trains
def test_two_launches_into_one_run_directory_at_once_the_second_is_refused(tmp_path, run_cache):
    from run_helpers import SMALL

    run_dir = tmp_path / "run"
    output = open(tmp_path / "first.out", "w")  # a file, not a pipe nobody reads while it trains
    first = subprocess.Popen([sys.executable, "-m", "areal_flow.launch", *SMALL, f"cache_dir={run_cache}",
                              f"hydra.run.dir={run_dir}", "total_steps=1000", "checkpoint.stop_timeout=30"], cwd=tmp_path,
                             stdout=output, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and metrics.stat().st_size):  # it trains
            assert first.poll() is None and time.monotonic() < deadline, "the first run never started"
            time.sleep(0.5)
        for extra, head in (((), ""), (("resume=auto",), "resume=auto: ")):
            r = subprocess.run([sys.executable, "-m", "areal_flow.launch", *SMALL, f"cache_dir={run_cache}",
                                f"hydra.run.dir={run_dir}", *extra], cwd=tmp_path, capture_output=True, text=True,
                               timeout=120)
            assert r.returncode == 2, r.stdout + r.stderr
            assert r.stdout.strip() == f"error: {head}hydra.run.dir={run_dir} is in use by a live run (launcher pid " \
                                       f"{first.pid}): wait for it to end or stop it, or choose another run directory"
        assert first.poll() is None  # the refused launches left the live run alone
    finally:
        first.send_signal(signal.SIGINT)
        first.wait(timeout=120)
        output.close()
    assert first.returncode == 130, (tmp_path / "first.out").read_text()[-3000:]


@pytest.mark.parametrize("state,refused", [("RUNNING", True), ("PENDING", True), ("REQUEUED", True),
                                           ("COMPLETED", False), ("CANCELLED", False), ("NODE_FAIL", False)])
def test_a_directory_whose_slurm_job_is_queued_or_running_is_refused_naming_the_job(tmp_path, monkeypatch, state,
                                                                                     refused):
    """launcher.type=slurm leaves once the job is submitted: the directory keeps the job's id and a
    later launch asks Slurm (a stand-in scontrol here) whether it still runs."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    asked = bin_dir / "asked"
    (bin_dir / "scontrol").write_text(f"#!/bin/bash\necho \"$@\" >> {asked}\n"
                                      f"echo 'JobId=4242 JobName=areal JobState={state} Reason=None'\n")
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lock.note_slurm_job(str(run_dir), "4242")
    if refused:
        with pytest.raises(lock.RunDirBusy, match=rf"^resume=auto: R is in use by Slurm job 4242 \({state}\): "
                                                  r"scancel 4242 or wait for it to end"):
            lock.hold_run_dir(str(run_dir), "resume=auto: R")
    else:
        lock.hold_run_dir(str(run_dir), "resume=auto: R")
    assert asked.read_text() == "show job 4242 --oneliner\n"


def test_a_noted_slurm_job_that_slurm_cannot_ask_about_does_not_hold_the_directory(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lock.note_slurm_job(str(run_dir), "4242")
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))  # no scontrol here (a copy of a cluster's run)
    assert lock.live_slurm_job(str(run_dir)) is None
