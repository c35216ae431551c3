"""Multi-turn runs survive faults as one-turn runs do: a rollout worker killed mid-tool-call is
restarted alone, leaving no sandboxed program or sandbox behind, and a checkpoint taken while
trajectories are mid-turn resumes with every group trained once (the ledger exact)."""

import os
import signal
import time
from pathlib import Path

import pytest
from run_helpers import check_accounting, jsonl, leftover_processes, processes_of_uids
from test_resume_end_to_end import start, wait_for_step

from areal_flow.envs.python_tool import MAX_BOXES, PID_SPAN
from areal_flow.rollout import live
from areal_flow.training import flight
from areal_flow.sandbox.local import UID_BASE
from chaos import run_processes

pytestmark = pytest.mark.slow

ENVS = str(Path(__file__).parent / "envs")
MULTI_TURN = ("+graph.generate.env=sleepy_env:Sleepy", "graph.generate.max_turns=3",
              "graph.generate.outputs=[prompt_ids,output_ids,behav_logprobs,versions,loss_mask]",
              "graph.actor_train.inputs=[prompt_ids,output_ids,behav_logprobs,versions,prox_logprobs,rewards,"
              "loss_mask]")


@pytest.fixture(autouse=True)
def sleepy_importable(monkeypatch):
    """The launcher and its processes import the test's environment by its module path."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [ENVS, os.environ.get("PYTHONPATH")])))


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def test_a_worker_killed_mid_tool_call_restarts_alone_and_a_checkpoint_mid_turn_resumes_exactly(tmp_path, run_cache):
    """One run (two would cost the suite another half minute): the rollout worker is SIGKILLed
    while one of its sandboxed programs runs, then the run is stopped by SIGTERM while
    trajectories are mid-turn, and resumed."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    proc = start(run_dir, run_cache, "total_steps=200", "resume=auto", "checkpoint.every_steps=2", *MULTI_TURN)
    try:
        wait_for_step(run_dir, 2, proc)
        worker = run_processes(str(run_dir))["rollout0"]
        box_uids = {UID_BASE + (k + 1) * PID_SPAN + worker for k in range(MAX_BOXES)}
        deadline = time.monotonic() + 30
        while not processes_of_uids(box_uids):  # a tool call in flight: a sandboxed program running
            assert time.monotonic() < deadline, "no tool call seen in flight"
            time.sleep(0.02)
        inits = children(worker)  # its sandboxes' resident inits
        os.kill(worker, signal.SIGKILL)
        wait_for_step(run_dir, 5, proc)  # the restarted worker's trajectories train
        assert inits and not [p for p in inits if Path(f"/proc/{p}").exists()]
        assert processes_of_uids(box_uids) == []  # no program of the killed worker's sandboxes runs on
        proc.send_signal(signal.SIGTERM)  # trajectories are mid-turn: most of their life is a tool call
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, out[-3000:]
    assert "process 'rollout0' was killed by signal 9: restarted, the run goes on" in out, out[-3000:]
    assert "recover:" not in out  # the run itself was never restarted
    steps = check_accounting(run_dir, eta=2)["steps"]
    # The stop's checkpoint kept the trajectories in flight at their last turn's boundary (rollout/live.py).
    kept = live.load(str(max((run_dir / "checkpoints").glob("step-*"))))
    assert kept and live.tokens([k for ks in kept.values() for k in ks]) > 0
    r = start(run_dir, run_cache, "resume=auto", f"total_steps={steps + 2}", *MULTI_TURN)
    out, _ = r.communicate(timeout=300)
    assert r.returncode == 0, out[-3000:]
    summary = check_accounting(run_dir, eta=2)
    assert summary["steps"] == steps + 2 and summary["resumes"] == 1
    assert summary["trained_samples"] == (steps + 2) * 2 * 4
    assert not leftover_processes(run_dir)
    # Each kept group admitted again at its first version, with every token it kept (the ledger's
    # figure), and trained with them: its samples go on from their kept tokens, exactly.
    readmitted = {e["group"]: e for e in jsonl(run_dir / "ledger.jsonl") if e["event"] == "admit" and e.get("resumed")}
    for group, trajectories in kept.items():
        assert readmitted[group]["kept_tokens"] == live.tokens(trajectories)
    trained = {s.uid: s for step in flight.recorded_steps(str(run_dir)) for s in flight.read(str(run_dir), step).samples}
    for group, trajectories in kept.items():
        for k in trajectories:
            sample = trained[f"g{group}-{k.index}"]
            for key, values in (("output_ids", k.output_ids), ("versions", k.versions), ("loss_mask", k.loss_mask),
                                ("behav_logprobs", k.logprobs)):
                assert sample.arrays[key].numpy().tolist()[:len(values)] == pytest.approx(values), (group, key)
