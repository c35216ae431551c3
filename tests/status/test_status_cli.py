"""`python -m areal_flow.status RUN_DIR --once` and the processes.json it reads: the local launcher
records each process's pid, exit and restart; on a real run the view shows the run's own numbers."""

import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from areal_flow.graph.placement import Proc
from areal_flow.launchers.local import LocalLauncher
from areal_flow.status.processes import read_processes
from areal_flow.status.render import pct, rate
from areal_flow.status.snapshot import read_snapshot
from run_helpers import SMALL, jsonl, run_processes


def py(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def status(run_dir, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "areal_flow.status", str(run_dir), "--once", "--width", "220", *args],
                          capture_output=True, text=True, timeout=60)


def test_the_local_launcher_records_pids_exits_and_restarts_in_processes_json(tmp_path):
    launcher = LocalLauncher(str(tmp_path), stop_timeout=2)
    launcher.start(Proc("controller", "controller"), py("import time; time.sleep(60)"))
    again = lambda: (py("import time; time.sleep(60)"), {})  # noqa: E731
    launcher.start(Proc("reward0", "reward"), py("import sys, time; time.sleep(0.2); sys.exit(3)"), again=again,
                   restarts=1)
    try:
        table = read_processes(str(tmp_path))
        assert set(table) == {"controller", "reward0"}
        for name, child in launcher.children.items():
            e = table[name]
            assert (e["pid"], e["host"], e["state"], e["restarts"], e["exit_code"]) == \
                (child.popen.pid, socket.gethostname(), "running", 0, None)
        assert table["reward0"]["role"] == "reward"
        first = launcher.children["reward0"].popen
        first.wait(timeout=10)
        assert launcher.check("controller") is False  # reward0 died and was started again
        table = read_processes(str(tmp_path))
        again_pid = launcher.children["reward0"].popen.pid
        assert again_pid != first.pid
        assert (table["reward0"]["pid"], table["reward0"]["state"], table["reward0"]["restarts"]) == \
            (again_pid, "restarted", 1)
        assert table["controller"]["state"] == "running"
    finally:
        launcher.stop_all()
    table = read_processes(str(tmp_path))
    assert {n: (e["state"], e["exit_code"]) for n, e in table.items()} == \
        {"controller": ("exited", -15), "reward0": ("exited", -15)}  # SIGTERM from stop_all
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]  # written by rename


def test_a_path_that_is_not_a_run_directory_is_named_in_the_error(tmp_path):
    r = status(tmp_path / "nowhere")
    assert r.returncode == 2 and f"{tmp_path / 'nowhere'}: no such directory" in r.stderr and not r.stdout
    r = status(tmp_path)
    assert r.returncode == 2 and f"{tmp_path} is not a run directory" in r.stderr


def status_piped(run_dir, *args: str) -> subprocess.CompletedProcess:
    """`python -m areal_flow.status RUN_DIR` without --once, its output a pipe (a script, CI)."""
    return subprocess.run([sys.executable, "-m", "areal_flow.status", str(run_dir), "--width", "220", *args],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, timeout=30)


def fake_run(run_dir, *rows: dict, summary: dict | None = None):
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"time": time.time(), **r}) + "\n" for r in rows))
    if summary is not None:
        (run_dir / "summary.json").write_text(json.dumps(summary))
    return run_dir


def test_a_finished_run_with_its_output_a_pipe_gets_one_view_and_an_exit(tmp_path):
    # A running run's piped view exits too: test_status_once_on_a_real_run_shows_its_numbers.
    reason = {"kind": "wall_time", "message": "max_wall_seconds=5 reached after 1 of 10 steps"}
    finished = fake_run(tmp_path / "finished", {"event": "start", "total_steps": 10}, {"event": "step", "step": 1},
                        summary={"steps": 1, "stopped": False, "stop_reason": reason})
    r = status_piped(finished)
    assert r.returncode == 0 and r.stdout.count("areal_flow status") == 1, r.stdout + r.stderr
    assert "the controller finished 1 steps: max_wall_seconds=5 reached after 1 of 10 steps" in r.stdout


def test_a_finished_run_on_a_terminal_gets_one_view_and_an_exit(tmp_path):
    import pty
    import select

    run_dir = fake_run(tmp_path / "run", {"event": "start", "total_steps": 2}, {"event": "step", "step": 2},
                       summary={"steps": 2, "stopped": False})
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "areal_flow.status", str(run_dir), "--width", "160"],
                            stdout=slave, stderr=slave, stdin=subprocess.DEVNULL)
    os.close(slave)
    out, deadline = b"", time.monotonic() + 30
    try:
        while time.monotonic() < deadline:
            if select.select([master], [], [], 0.1)[0]:
                try:
                    out += os.read(master, 65536)
                except OSError:  # the process exited and closed its end
                    break
            elif proc.poll() is not None:
                break
        assert proc.wait(timeout=max(0.1, deadline - time.monotonic())) == 0
    finally:
        proc.kill()
        os.close(master)
    assert b"the controller finished 2 steps" in out


def cells(text: str, label: str) -> list[str]:
    """The cells of the first table row of the view whose first cell is `label`."""
    for line in text.splitlines():
        parts = [c.strip() for c in line.split("│")]
        for i, c in enumerate(parts):
            if c == label:
                return parts[i + 1:]
    raise AssertionError(f"no row {label!r} in:\n{text}")


def window_rate(rows: list[dict], key: str, weight: str = "step_seconds") -> float:
    return sum(r[key] * r[weight] for r in rows) / sum(r[weight] for r in rows)


@pytest.mark.slow
def test_status_once_on_a_real_run_shows_its_numbers(tmp_path, run_cache):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "areal_flow.launch", *SMALL, f"cache_dir={run_cache}", f"hydra.run.dir={run_dir}",
           "total_steps=12"]  # a few seconds of steps: the view looks while they run
    launch = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    try:
        # While it runs: processes.json names every process the launcher started, by its pid.
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and launch.poll() is None:
            table = read_processes(str(run_dir)) or {}
            if len(table) == 5 and all(e["state"] == "running" for e in table.values()):
                break
            time.sleep(0.05)
        assert launch.poll() is None, launch.communicate()[0][-3000:]
        assert {n: e["pid"] for n, e in table.items()} == run_processes(run_dir)
        assert {e["role"] for e in table.values()} == {"controller", "gen_server", "rollout", "reward", "trainer"}
        # Once the controller has started the run (its servers answer): live, probed.
        while time.monotonic() < deadline and (snap := read_snapshot(str(run_dir))).state != "running" \
                and launch.poll() is None:
            time.sleep(0.05)
        assert snap.state == "running" and snap.live, snap.note
        piped = status_piped(run_dir)  # a live view would print nothing until Ctrl-C: one view instead
        assert piped.returncode == 0 and "running" in piped.stdout, piped.stdout[-3000:] + piped.stderr
        assert all(p.alive for p in snap.processes), snap.processes
        assert next(p for p in snap.processes if p.name == "gen_server0").health == "ok"
        out, _ = launch.communicate(timeout=300)
        assert launch.returncode == 0, out[-3000:]
    finally:
        if launch.poll() is None:
            launch.kill()
            launch.wait()

    r = status(run_dir)
    assert r.returncode == 0, r.stderr
    text = r.stdout
    piped = status_piped(run_dir)  # the finished run, without --once: its view, and an exit
    assert piped.returncode == 0 and cells(piped.stdout, "step")[0] == "12 / 12 (100%)", piped.stderr
    metrics = jsonl(run_dir / "metrics.jsonl")
    steps = [m for m in metrics if m["event"] == "step"]
    last, window = steps[-1], steps[-10:]
    assert len(steps) == 12 and "finished" in text and "the controller finished 12 steps: total_steps=12 reached" in text
    assert cells(text, "step")[0] == "12 / 12 (100%)"
    assert cells(text, "trained version")[0] == "12"
    loaded = [e for e in jsonl(run_dir / "ledger.jsonl") if e["event"] == "loaded"][-1]["version"]
    assert cells(text, "loaded version (servers)")[0] == str(loaded) == "12"
    assert cells(text, "samples / s")[:2] == [rate(last["samples_per_second"]),
                                              rate(window_rate(window, "samples_per_second"))]
    assert cells(text, "generated tokens / s")[:2] == [rate(last["gen_tokens_per_second"]),
                                                       rate(window_rate(window, "gen_tokens_per_second"))]
    assert cells(text, "trained tokens / s")[:2] == [
        rate(last["train_tokens_per_second"]), rate(window_rate(window, "train_tokens_per_second", "train_seconds"))]
    assert cells(text, "trainer")[:2] == [pct(1 - last["trainer_idle"]),
                                          pct(1 - window_rate(window, "trainer_idle"))]
    if last.get("generator_idle") is not None:
        assert cells(text, "generator")[0] == pct(1 - last["generator_idle"])
    assert cells(text, "max (last step)")[0] == str(last["staleness_max"])
    assert cells(text, "max (whole run)")[0] == str(max(s["staleness_max"] for s in steps))
    assert cells(text, "mean (last step)")[0] == f"{last['staleness_mean']:.2f}"
    evals = [m for m in metrics if m["event"] == "eval"]
    assert cells(text, "last")[0].startswith(f"{pct(evals[-1]['accuracy'])} ") and "at end" in cells(text, "last")[0]
    assert cells(text, "first")[0].startswith(f"{pct(evals[0]['accuracy'])} ")
    table = read_processes(str(run_dir))
    assert table["controller"]["exit_code"] == 0
    for name, e in table.items():
        row = cells(text, name)
        assert row[2] == str(e["pid"]) and row[3].startswith("exited"), row
