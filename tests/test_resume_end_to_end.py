"""A run survives faults: it resumes from its checkpoints, restarts itself after a dead process, and
stops with a checkpoint; across all of it every prompt group is trained once or accounted for."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from run_helpers import check_accounting, jsonl, launch, leftover_processes, small_with, steps_of, wait_for_step

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from chaos import run_processes  # noqa: E402  (each process itself, not its scoring pool)

pytestmark = pytest.mark.slow

QUIET = ("eval_at_start=false", "eval_at_end=false")


def checkpoints(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def start(run_dir: Path, cache: Path, *overrides: str) -> subprocess.Popen:
    """Launch in the background with SMALL's settings, where `overrides` do not set the same key."""
    cmd = [sys.executable, "-m", "areal_flow.launch", f"cache_dir={cache}", f"hydra.run.dir={run_dir}", *QUIET,
           *small_with(*overrides)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=run_dir.parent)


def test_a_stopped_run_saves_a_checkpoint_and_resumes_from_it(tmp_path, run_cache):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    proc = start(run_dir, run_cache, "total_steps=200", "resume=auto", "checkpoint.every_steps=2",
                 "checkpoint.keep_last=1")
    try:
        wait_for_step(run_dir, 3, proc)
        proc.send_signal(signal.SIGTERM)  # a scheduler's preemption
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert "holds no complete checkpoint: starting the run" in out
    assert proc.returncode == 130, out[-3000:]
    assert "interrupted (SIGTERM): the run saves a checkpoint after the current step" in out, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = summary["steps"]
    assert summary["stopped"] and 3 <= steps < 200
    assert summary["stop_reason"]["kind"] == "stop_request"
    assert f"stopped: stop requested (SIGUSR1: the launcher's Ctrl-C or SIGTERM) after {steps} of 200 steps; " \
           f"continue with resume=auto hydra.run.dir={run_dir}" in out, out[-3000:]
    assert checkpoints(run_dir) == [f"step-{steps:08d}"]  # the older ones removed (keep_last=1)
    assert not leftover_processes(run_dir)
    # A key of the math changed: refused by name, before any process starts; nothing is changed.
    r = launch(run_dir, run_cache, *QUIET, "resume=auto", "algorithm.eps_clip=0.3")
    assert r.returncode == 2 and "algorithm.eps_clip: 0.2 -> 0.3" in r.stdout, r.stdout[-3000:]
    r = launch(run_dir, run_cache, *QUIET, "resume=auto", f"total_steps={steps + 2}")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"resuming from {run_dir / 'checkpoints' / f'step-{steps:08d}'} (step {steps})" in r.stdout
    # The first progress line is the resumed run's own first step, not an old step's figures.
    shown = [line.split(":")[0] for line in r.stdout.splitlines() if line.startswith("step ")]
    assert shown[0] == f"step {steps + 1}", r.stdout[-3000:]
    summary = check_accounting(run_dir, eta=2)
    assert summary["steps"] == steps + 2 and summary["resumes"] == 1
    assert summary["trained_samples"] == (steps + 2) * 2 * 4
    assert [m["step"] for m in steps_of(run_dir)] == list(range(1, steps + 3))  # each step's row once
    assert [m["event"] for m in jsonl(run_dir / "metrics.jsonl")].count("resume") == 1
    # The optimizer went on: the resumed trainer's weights carry on the versions, published as such.
    assert (run_dir / "weights" / f"v{steps + 2}").is_dir() and not leftover_processes(run_dir)


def test_a_dead_server_rollout_or_reward_worker_is_restarted_alone_and_the_run_goes_on(tmp_path, run_cache):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    victims = ("gen_server0", "rollout0", "reward0")
    # Steps enough after the last kill for the restarted workers to say hello before the run ends:
    # with 12 it once ended on groups already scored, before the controller heard from them.
    proc = start(run_dir, run_cache, "total_steps=16")
    try:
        for victim, step in zip(victims, (2, 5, 8)):
            wait_for_step(run_dir, step, proc)
            os.kill(run_processes(str(run_dir))[victim], signal.SIGKILL)
        out, _ = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-3000:]
    for victim in victims:
        assert f"process '{victim}' was killed by signal 9: restarted, the run goes on" in out, out[-3000:]
    assert "recover:" not in out  # the run itself was never restarted
    summary = check_accounting(run_dir, eta=2)
    assert summary["steps"] == 16 and summary["resumes"] == 0
    controller = (run_dir / "logs" / "controller.log").read_text()
    assert "rollout0 restarted; its" in controller and "reward0 restarted; the rollout workers send" in controller
    # The rollout worker's requests fail while the server is down, so its pool takes the server back;
    # the controller's notices only when an update of its fell in the gap (not under every timing).
    rollout = (run_dir / "logs" / "rollout0.log").read_text()
    assert "generation server gen_server0 is back" in rollout + controller
    assert not leftover_processes(run_dir)
