"""launcher.type=slurm against a real Slurm: two slurmd nodes, each in a network namespace of its own
(conftest.py), so the run's roles talk across two addresses as on two machines, and the weights
cross from the trainer's node to the server's by a gloo broadcast (weight_update_mode=distributed).

A job trains and ends; `scancel` stops it and `resume=auto` in a new job continues it exactly; a
time limit ends it with a checkpoint (--signal); a node that dies ends it naming the node and loses
no group; what Slurm refuses is said in one line naming the setting."""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from run_helpers import ANSWERS_SOME, SMALL, check_accounting, jsonl, run_processes, small_with, steps_of
from safetensors.torch import load_file

from areal_flow.runtime.security import is_loopback

pytestmark = pytest.mark.cluster

TWO_NODES = ("launcher.type=slurm", "cluster.n_nodes=2", "cluster.n_devices=1", "eval_at_start=false",
             "rollout.weight_update_mode=distributed", "rollout.interrupt=true")
BASE_MODELS = [ANSWERS_SOME]
# η = 0, from a model that answers some problems (so every step moves the weights), a checkpoint
# every 2 steps: the uninterrupted run and the cancelled-then-resumed one train the same steps.
EXACT = ("rollout.max_staleness=0", "total_steps=6", "eval_at_end=false", "checkpoint.every_steps=2", *ANSWERS_SOME)


def submit(slurm, run_dir: Path, cache: Path, *overrides: str) -> str:
    """Launch a SMALL run with launcher.type=slurm on the two nodes: the job id it submitted."""
    r = subprocess.run([sys.executable, "-m", "areal_flow.launch", f"cache_dir={cache}", f"output_dir={run_dir}",
                        *TWO_NODES, *small_with(*overrides)],
                       capture_output=True, text=True, env=slurm.env, timeout=300, cwd=run_dir.parent)
    found = re.search(r"submitted Slurm job (\d+)", r.stdout)
    assert r.returncode == 0 and found, r.stdout[-3000:] + r.stderr[-3000:]
    return found.group(1)


def job_log(run_dir: Path, job_id: str) -> str:
    return (run_dir / "logs" / f"job-{job_id}.log").read_text()


def ended(slurm, run_dir: Path, job_id: str, state: str = "COMPLETED", timeout: float = 300) -> dict:
    job = slurm.wait_job(job_id, timeout)
    assert job["JobState"] == state, (job, job_log(run_dir, job_id)[-3000:])
    assert not run_processes(run_dir), "a process of the run outlived its job"
    return job


def wait_for(predicate, what: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.2)


def test_a_job_on_two_nodes_trains_across_their_addresses(slurm, run_cache, tmp_path):
    run_dir = tmp_path / "run"
    job = submit(slurm, run_dir, run_cache, *EXACT)
    assert ended(slurm, run_dir, job)["ExitCode"] == "0:0"
    summary = check_accounting(run_dir, eta=0, group_size=8)
    assert summary["steps"] == 6 and not summary["stopped"]
    # Node 0 (n1) runs the controller, the generation server, the rollout and reward workers;
    # node 1 (n2) the trainer: each process was reached at its own node's address, none at loopback.
    spec = json.loads((run_dir / "spec.json").read_text())
    first, second = slurm.hosts.addresses
    assert spec["hosts"]["trainer0"] == second and spec["hosts"]["gen_server0"] == spec["hosts"]["controller"] == first
    assert not any(is_loopback(a) for a in spec["hosts"].values()) and spec["gen_host"] == first
    assert json.loads((run_dir / "slurm_hosts.json").read_text())["trainer0"]["hostname"] == "n2"
    # Every version reached the server on the other node by the gloo broadcast.
    server_log = (run_dir / "logs" / "gen_server0.log").read_text()
    assert f"joined weights group 'weight_update_group' as rank 1 of 2 (gloo, store at {second}:" in server_log
    assert all(f"weights from weights group 'weight_update_group' (51 tensors) loaded, version {v}\n" in server_log
               for v in range(1, 7))


def test_scancel_stops_the_job_and_resume_auto_continues_it_exactly(slurm, run_cache, tmp_path):
    """η = 0: a job cancelled after its checkpoint of step 2, then resumed in a new job, ends with
    the weights of one never stopped, bit for bit."""
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    ended(slurm, whole, submit(slurm, whole, run_cache, *EXACT))
    job = submit(slurm, cut, run_cache, *EXACT, "checkpoint.keep_last=3")
    wait_for(lambda: (cut / "checkpoints" / "step-00000002" / "manifest.json").exists(), "a checkpoint of step 2")
    # While the job runs, a second launch into its directory is refused, naming the job.
    busy = subprocess.run([sys.executable, "-m", "areal_flow.launch", f"cache_dir={run_cache}", f"output_dir={cut}",
                           *TWO_NODES, *small_with(*EXACT, "resume=auto")],
                          capture_output=True, text=True, env=slurm.env, timeout=300, cwd=tmp_path)
    assert busy.returncode == 2 and f"is in use by Slurm job {job} (RUNNING): scancel {job}" in busy.stdout, busy.stdout
    slurm.command("scancel", job)
    ended(slurm, cut, job, "CANCELLED", timeout=60)
    assert "areal_flow: the job was cancelled" in job_log(cut, job)
    again = submit(slurm, cut, run_cache, *EXACT, "checkpoint.keep_last=3", "resume=auto")
    ended(slurm, cut, again)
    summary = check_accounting(cut, eta=0, group_size=8)
    assert summary["steps"] == 6 and summary["resumes"] == 1
    a, b = (load_file(d / "checkpoint" / "model.safetensors") for d in (whole, cut))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    def story(run_dir):
        trained = [(e["step"], e["groups"]) for e in jsonl(run_dir / "ledger.jsonl") if e["event"] == "train"]
        return trained, [r["uids"] for r in jsonl(run_dir / "trained-rank0.jsonl")]

    assert story(whole) == story(cut)


def test_a_time_limit_ends_the_job_with_a_checkpoint_that_resumes(slurm, run_cache, tmp_path):
    """--time=2 (minutes) and the signal 75 s before it, due at 45 s: Slurm checks about every 30 s
    and signals at the first check less than 30 s before it is due, so between 15 and 45 s in; the
    run stops after its step with a checkpoint, and the job ends (130, as a stopped local run)
    before the limit."""
    run_dir = tmp_path / "run"
    job = submit(slurm, run_dir, run_cache, "total_steps=100000", "launcher.slurm_time=2",
                 "launcher.slurm_stop_before=75")
    record = ended(slurm, run_dir, job, "FAILED", timeout=150)
    assert record["ExitCode"] == "130:0"
    said = [line for line in job_log(run_dir, job).splitlines() if line.startswith("areal_flow: SIGUSR1")]
    assert len(said) == 1 and "(Slurm before the time limit, launcher.slurm_time=2, " in said[0] and \
        "the run stops after its current step, with a checkpoint; resume=auto continues it" in said[0], said
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped"] and summary["stop_reason"]["kind"] == "stop_request"
    steps = summary["steps"]
    assert steps > 0 and (run_dir / "checkpoints" / f"step-{steps:08d}" / "manifest.json").exists()
    again = submit(slurm, run_dir, run_cache, f"total_steps={steps + 2}", "resume=auto")
    ended(slurm, run_dir, again)
    summary = check_accounting(run_dir, eta=2)
    assert summary["steps"] == steps + 2 and summary["resumes"] == 1
    assert [m["step"] for m in steps_of(run_dir)] == list(range(1, steps + 3))


def test_a_node_that_dies_ends_the_job_naming_it_and_the_requeued_job_loses_no_group(slurm, run_cache, tmp_path):
    """Every process of node n2 (its slurmd, the trainer) is killed mid-run, as a machine losing
    power: Slurm ends the job and requeues it, the log names the node, and once the node is back
    the requeued job goes on from the run's last checkpoint, every admitted group trained once or
    accounted for."""
    run_dir = tmp_path / "run"
    job = submit(slurm, run_dir, run_cache, "total_steps=20", "checkpoint.every_steps=2")
    wait_for(lambda: (run_dir / "checkpoints" / "step-00000002" / "manifest.json").exists(), "a checkpoint")
    assert slurm.hosts.kill(1)
    second = slurm.hosts.addresses[1]
    named = rf"node 1 \(n2, {re.escape(second)}, which Slurm reports [A-Z_+]*(DOWN|\*)"
    try:
        wait_for(lambda: re.search(named, job_log(run_dir, job)), "the job's log naming the dead node", timeout=120)
    finally:
        slurm.start_node(1)
    # Slurm holds a requeued job about two minutes before it may start again; a user (or an admin)
    # lets it go at once as here.
    slurm.wait_job(job, 60, until=lambda j: j.get("JobState") == "PENDING" and j.get("Restarts") == "1")
    slurm.command("scontrol", "update", f"JobId={job}", "StartTime=now")
    record = ended(slurm, run_dir, job, timeout=240)
    log = job_log(run_dir, job)
    assert record["Restarts"] == "1" and "areal_flow: the job was requeued (start 2): the run goes on from its " \
        f"checkpoint {run_dir}/checkpoints/step-" in log, log[-3000:]
    summary = check_accounting(run_dir, eta=2)
    assert summary["resumes"] == 1 and summary["steps"] == 20
    assert [m["step"] for m in steps_of(run_dir)] == list(range(1, 21))


@pytest.mark.parametrize("setting,said", [
    ("launcher.slurm_partition=nosuch", "the partition does not exist: launcher.slurm_partition=nosuch"),
    ("cluster.n_nodes=3", "more nodes than the partition allows or has: cluster.n_nodes=3"),
    ("launcher.slurm_time=90", "a longer time limit than the partition allows: launcher.slurm_time=90"),
    ("cluster.n_devices=4", "cluster.n_devices=4 (CPUs a node, cluster.device_type=cpu)"),
])
def test_what_slurm_refuses_is_said_in_one_line_naming_the_setting(slurm, run_cache, tmp_path, setting, said):
    run_dir = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "areal_flow.launch", *SMALL, f"cache_dir={run_cache}",
                        f"output_dir={run_dir}", *TWO_NODES, setting],
                       capture_output=True, text=True, env=slurm.env, timeout=300, cwd=tmp_path)
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    lines = [line for line in (r.stdout + r.stderr).splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and said in lines[0], lines
    # Nothing is left in the queue.
    assert slurm.command("squeue", "--noheader").stdout.strip() == ""
