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
