"""`areal_flow.status`'s reading and rendering, on a hand-built run directory in the run's real
file formats: metrics.jsonl, ledger.jsonl, trained-rank*.jsonl, spec.json, processes.json, logs/."""

import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from rich.console import Console

from areal_flow.status.processes import write_processes
from areal_flow.status.render import render
from areal_flow.status.model import NotARunDirectory
from areal_flow.status.snapshot import RunReader, read_snapshot

API_KEY = "secret-key"


def row(event, **values):
    return json.dumps({"event": event, "time": 1_700_000_000.0, **values}) + "\n"


STEPS = [  # what the controller's step row holds (controller/step_metrics.py), the keys the view reads (others beside them)
    dict(step=1, reward=0.25, step_seconds=2.0, train_seconds=1.0, samples_per_second=32.0,
         gen_tokens_per_second=1000.0, train_tokens_per_second=2000.0, trainer_idle=0.5, generator_idle=0.1,
         **{"reward_busy/reward": 0.02, "train/n_valid_tokens": 100.0, "sent_bytes/controller": 10},
         staleness_mean=0.0, staleness_max=0, staleness_hist=[100], elapsed=2.0),
    dict(step=2, reward=0.5, step_seconds=1.0, train_seconds=0.5, samples_per_second=64.0,
         gen_tokens_per_second=3000.0, train_tokens_per_second=4000.0, trainer_idle=0.5, generator_idle=0.2,
         **{"reward_busy/reward": 0.04, "train/n_valid_tokens": 100.0},
         staleness_mean=0.5, staleness_max=1, staleness_hist=[50, 50], elapsed=3.0),
    dict(step=3, reward=0.75, step_seconds=1.0, train_seconds=0.5, samples_per_second=64.0,
         gen_tokens_per_second=2000.0, train_tokens_per_second=3000.0, trainer_idle=0.2, generator_idle=0.0,
         **{"reward_busy/reward": 0.06, "train/n_valid_tokens": 80.0, "train/ess_fraction": 0.9,
            "by_length/reward/q1": 0.8, "by_length/reward/q2": 0.6,
            "by_length/samples/q1": 3, "by_length/samples/q2": None,
            "train/stale/0/weight_mean": 1.0, "train/stale/0/capped_fraction": 0.0,
            "train/stale/3-4/weight_mean": 1.75, "train/stale/3-4/capped_fraction": 0.125,
            "train/stale/stalest_grad_share_max": 0.625, "train/mismatch/0/abs_mean": 0.002,
            "train/mismatch/3-4/abs_mean": 0.25, "train/mismatch/abs_mean": 0.1},
         staleness_mean=1.0, staleness_max=1, staleness_hist=[0, 80], elapsed=4.0),
]


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


class Server(BaseHTTPRequestHandler):
    """A generation server's /health and /get_weight_version (the latter wants the run's key)."""

    def do_GET(self):
        if self.path == "/health":
            self.send_response(200)
            self.end_headers()
        elif self.path == "/get_weight_version" and self.headers.get("Authorization") == f"Bearer {API_KEY}":
            body = json.dumps({"weight_version": "3"}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:
            self.send_response(401)
            self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Server)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()


def build(run_dir, port: int, now: float, *, steps=STEPS) -> None:
    """A live run after 3 of 10 steps: the trainer has trained a 4th, the servers loaded version 3."""
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "config.yaml").write_text("total_steps: 10\nrecipe: tiny_arith\n")
    spec = {"run_dir": str(run_dir), "model_path": "m", "train_path": "t", "eval_path": "e", "gen_ports": [port],
            "controller_port": 1, "rollout_ports": [2], "trainer_ports": [3], "infer_ports": {}, "dist_port": 4,
            "n_trainers": 1, "n_rollout": 1, "gen_host": "127.0.0.1", "weights_dir": "", "host": "127.0.0.1",
            "hosts": {}, "security": {"api_key": API_KEY, "server_public": "", "server_secret": "",
                                      "client_public": "", "client_secret": ""}, "resume": ""}
    (run_dir / "spec.json").write_text(json.dumps(spec))
    with open(run_dir / "metrics.jsonl", "w") as f:
        f.write(row("start", total_steps=10, batch_size=8, group_size=8, max_staleness=2))
        f.write(row("eval", when="start", step=0, accuracy=0.25, seconds=1.0))
        for s in steps[:2]:
            f.write(row("step", **s))
        f.write(row("eval", when="version 2", step=2, version=2, accuracy=0.5, n=200, seconds=1.0))
        for s in steps[2:]:
            f.write(row("step", **s))
    with open(run_dir / "ledger.jsonl", "w") as f:
        for v in (1, 2, 3):
            f.write(json.dumps({"event": "admit", "time": 1.0, "group": v, "prompt_id": "p", "version": v - 1}) + "\n")
            f.write(json.dumps({"event": "loaded", "time": 1.0, "version": v, "seconds": 0.1}) + "\n")
        f.write(json.dumps({"event": "admit", "time": 1.0, "group": 9, "prompt_id": "p", "version": 3}) + "\n")
    (run_dir / "trained-rank0.jsonl").write_text("".join(json.dumps({"step": s, "uids": [], "nodes": []}) + "\n"
                                                         for s in range(4)))
    host, me = socket.gethostname(), os.getpid()

    def proc(role, pid, state="running", restarts=0, code=None, ended=None):
        return {"role": role, "pid": pid, "host": host, "restarts": restarts, "state": state, "exit_code": code,
                "started": now - 60, "ended": ended}

    write_processes(str(run_dir), {
        "controller": proc("controller", me), "gen_server0": proc("gen_server", me),
        "rollout0": proc("rollout", dead_pid(), "exited", code=0, ended=now - 5),
        "reward0": proc("reward", me, "restarted", restarts=1),
        "trainer0": proc("trainer", dead_pid()),  # its pid is gone: the view says so
        "gen_server1": proc("gen_server", dead_pid(), "removed", code=0, ended=now - 20),  # a scale took it out
    })
    for i, name in enumerate(("controller", "gen_server0", "rollout0", "reward0", "trainer0")):
        log = run_dir / "logs" / f"{name}.log"
        log.write_text("a line\n")
        os.utime(log, (now - 10 * (i + 1), now - 10 * (i + 1)))


def export(snap) -> str:
    console = Console(record=True, width=200, file=open(os.devnull, "w"))
    console.print(render(snap))
    return console.export_text()


def test_a_live_run_reads_into_the_right_numbers_and_shows_them(tmp_path, server):
    now = time.time()
    build(tmp_path / "run", server, now)
    snap = RunReader(str(tmp_path / "run")).snapshot(now=now)
    assert (snap.state, snap.live) == ("running", True)
    assert (snap.step, snap.total_steps, snap.elapsed) == (3, 10, 4.0)
    assert (snap.trained_version, snap.loaded_version) == (4, 3)
    assert snap.window == 3
    # The last step's figures, and the window's: totals over its seconds.
    assert (snap.samples_per_second.last, snap.samples_per_second.window) == (64.0, pytest.approx(48.0))
    assert (snap.gen_tokens_per_second.last, snap.gen_tokens_per_second.window) == (2000.0, pytest.approx(1750.0))
    # Trained tokens per second of training (train_seconds), not of the step.
    assert (snap.train_tokens_per_second.last, snap.train_tokens_per_second.window) == (3000.0, pytest.approx(2750.0))
    assert snap.trainer_busy.last == pytest.approx(0.8) and snap.trainer_busy.window == pytest.approx(0.575)
    assert snap.generator_busy.last == pytest.approx(1.0) and snap.generator_busy.window == pytest.approx(0.9)
    assert set(snap.reward_busy) == {"reward"} and snap.reward_busy["reward"].window == pytest.approx(0.035)
    assert snap.reward.last == 0.75
    st = snap.staleness
    assert (st.mean, st.max, st.hist, st.run_max, st.run_hist) == (1.0, 1, [0, 80], 1, [150, 130])
    assert st.window_mean == pytest.approx(130 / 280) and st.seq_hist is None
    assert snap.eta == pytest.approx(7 * 4 / 3)  # 7 steps left at the window's mean step time
    assert (snap.first_eval.when, snap.first_eval.accuracy) == ("start", 0.25)
    last = snap.last_eval
    assert (last.accuracy, last.step, last.version, last.n) == (0.5, 2, 2, 200)
    assert snap.extras == {"train/ess_fraction": 0.9, "by_length/reward/q1": 0.8, "by_length/reward/q2": 0.6,
                           "by_length/samples/q1": 3, "by_length/samples/q2": None,
                           "train/stale/0/weight_mean": 1.0, "train/stale/0/capped_fraction": 0.0,
                           "train/stale/3-4/weight_mean": 1.75, "train/stale/3-4/capped_fraction": 0.125,
                           "train/stale/stalest_grad_share_max": 0.625, "train/mismatch/0/abs_mean": 0.002,
                           "train/mismatch/3-4/abs_mean": 0.25, "train/mismatch/abs_mean": 0.1}

    procs = {p.name: p for p in snap.processes}
    assert [p.name for p in snap.processes] == ["controller", "gen_server0", "gen_server1", "rollout0", "reward0",
                                                "trainer0"]
    assert (procs["gen_server1"].state, procs["gen_server1"].alive) == ("removed", False)
    assert procs["controller"].alive is True and procs["controller"].pid == os.getpid()
    assert procs["trainer0"].alive is False and procs["trainer0"].state == "running"  # recorded running, gone
    assert (procs["rollout0"].alive, procs["rollout0"].state, procs["rollout0"].exit_code) == (False, "exited", 0)
    assert (procs["reward0"].state, procs["reward0"].restarts) == ("restarted", 1)
    assert procs["controller"].log_age == pytest.approx(10) and procs["trainer0"].log_age == pytest.approx(50)
    gen = procs["gen_server0"]
    assert (gen.url, gen.health, gen.weight_version) == (f"http://127.0.0.1:{server}", "ok", "3")

    text = export(snap)
    for shown in ("running", "3 / 10 (30%)", "trained version", "64.0", "48.0", "2,000", "1,750", "3,000", "2,750",
                  "80.0%", "57.5%", "100.0%", "90.0%", "reward: reward", "3.5%", "0.75", "0.46", "1: 80 (100%)",
                  "0: 150 (54%)  1: 130 (46%)", "25.0% (step 0, at start)", "50.0% of 200 (version 2)",
                  "train/ess_fraction", "0.9", "gone (pid not alive)", "exited (0)",
                  "running (pid alive), restarted 1×", "10.0 s ago", "50.0 s ago", "last 3 steps"):
        assert shown in text, f"{shown!r} not in:\n{text}"
    removed = next(line for line in text.splitlines() if line.strip("│ ").startswith("gen_server1"))
    left = time.strftime("%H:%M:%S", time.localtime(now - 20))
    assert f"removed: joined {time.strftime('%H:%M:%S', time.localtime(now - 60))}, left {left}" in removed
    gen_line = next(line for line in text.splitlines() if line.strip("│ ").startswith("gen_server0"))
    assert " ok " in gen_line and gen_line.rstrip(" │").endswith("3")
    lines = text.splitlines()
    assert any(" ".join(line.split()).endswith("│by length: reward │ 0.8 │ 0.6│") for line in lines), text
    assert any(" ".join(line.split()).endswith("│by length: samples │ 3 │ -│") for line in lines), text
    # The behaviour weights by versions behind, one column a bucket, in a table of their own.
    assert "by versions behind (last step)" in text
    assert any(" ".join(line.split()).endswith("│weight mean │ 1 │ 1.75 │ -│") for line in lines), text
    assert any(" ".join(line.split()).endswith("│capped fraction │ 0 │ 0.125 │ -│") for line in lines), text
    assert any(" ".join(line.split()).endswith("│stalest grad share max │ 0.625 │ │ │") for line in lines), text
    # and the behaviour/trainer mismatch by the same columns, every token's in "all"
    assert any(" ".join(line.split()).endswith("│|Δ log p| mean │ 0.002 │ 0.25 │ 0.1│") for line in lines), text
    assert any("loaded version (servers)" in line and line.rstrip(" │").endswith("3") for line in lines)
    assert any("trained version" in line and line.rstrip(" │").endswith("4") for line in lines)
    assert "environment (per trajectory)" not in text and snap.env == {}  # one turn a sample: no such table


def test_a_multi_turn_run_shows_its_tool_figures(tmp_path, server):
    """The env/<figure>s of a run whose generate node takes turns: a table of their own, the last
    step's and the window's (weighted by step time, as every figure)."""
    now = time.time()
    steps = [dict(s, **{"env/turns": t, "env/tool_calls": t - 1, "env/tool_errors": 0.25 * (t - 1),
                        "env/tool_seconds": 0.02, "env/observation_tokens": 0.1 * t, "env/end_done": 1.0,
                        "env/repair_turn2": 0.5})
             for s, t in zip(STEPS, (1.0, 1.5, 2.0))]
    build(tmp_path / "run", server, now, steps=steps)
    snap = RunReader(str(tmp_path / "run"), probe=False).snapshot(now=now)
    assert snap.env["tool_calls"].last == 1.0 and snap.env["tool_calls"].window == pytest.approx(0.375)  # (0·2 + .5 + 1) / 4
    assert set(snap.env) == {"turns", "tool_calls", "tool_errors", "tool_seconds", "observation_tokens", "end_done",
                             "repair_turn2"}
    lines = [" ".join(line.split()) for line in export(snap).splitlines()]
    assert any("environment (per trajectory)" in line for line in lines)
    for shown in ("│turns │ 2.00 │ 1.38│", "│tool calls │ 1.00 │ 0.38│", "│tool errors │ 0.25 │ 0.09│",
                  "│observation tokens (share) │ 20.0% │ 13.8%│", "│repair turn2 │ 50.0% │ 50.0%│",
                  "│end done │ 100.0% │ 100.0%│"):
        assert any(line.endswith(shown) for line in lines), (shown, lines)


def test_the_window_holds_the_last_steps(tmp_path, server):
    now = time.time()
    build(tmp_path / "run", server, now)
    snap = RunReader(str(tmp_path / "run"), window=2, probe=False).snapshot(now=now)
    assert snap.window == 2 and snap.samples_per_second.window == pytest.approx(64.0)
    assert snap.staleness.run_hist == [150, 130]  # the whole run's, whatever the window
    assert "last 2 steps" in export(snap)


def test_a_torn_last_line_waits_for_its_end(tmp_path, server):
    now = time.time()
    run = tmp_path / "run"
    build(run, server, now, steps=STEPS[:2])
    third = row("step", **STEPS[2])
    with open(run / "metrics.jsonl", "a") as f:
        f.write(third[:57])  # the controller is writing it
    reader = RunReader(str(run), probe=False)
    snap = reader.snapshot(now=now)
    assert snap.step == 2 and snap.bad_lines == 0 and snap.samples_per_second.last == 64.0
    assert read_snapshot(str(run), probe=False).step == 2  # a fresh reader too
    with open(run / "metrics.jsonl", "a") as f:
        f.write(third[57:])
    snap = reader.snapshot(now=now)
    assert snap.step == 3 and snap.samples_per_second.window == pytest.approx(48.0)
    assert snap.staleness.run_hist == [150, 130]  # each row counted once


def test_metrics_cut_back_by_a_resume_are_read_again(tmp_path, server):
    """A resume cuts metrics.jsonl back to its checkpoint (checkpoint/store.py: rewind), and the run
    writes on from there: a reader that read past the cut starts again."""
    now = time.time()
    run = tmp_path / "run"
    build(run, server, now)
    reader = RunReader(str(run), probe=False)
    assert reader.snapshot(now=now).step == 3
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    redo = dict(STEPS[2], samples_per_second=16.0, staleness_hist=[80])
    (run / "metrics.jsonl").write_text("".join(lines[:4]) + row("resume", step=2, checkpoint="c", resumes=1)
                                       + row("step", **redo) + row("step", **dict(redo, step=4)))
    (run / "trained-rank0.discarded.jsonl").write_text(json.dumps({"step": 99, "uids": [], "nodes": []}) + "\n")
    snap = reader.snapshot(now=now)
    assert (snap.step, snap.samples_per_second.last, snap.staleness.run_hist) == (4, 16.0, [100 + 50 + 160, 50])
    assert snap.trained_version == 4  # the discarded log of the cut steps is not the trainer's


def test_a_finished_run_says_so_and_probes_nothing(tmp_path, server):
    now = time.time()
    run = tmp_path / "run"
    build(run, server, now)
    with open(run / "metrics.jsonl", "a") as f:
        f.write(row("eval", when="end", step=3, version=3, accuracy=0.625, seconds=1.0))
        f.write(row("summary", steps=3, stopped=False, trained_samples=192, samples_per_second=48.0,
                    stop_reason={"kind": "wall_time", "message": "max_wall_seconds=5 reached after 3 of 10 steps"}))
    snap = read_snapshot(str(run))
    assert (snap.state, snap.live) == ("finished", False)
    assert snap.note == "the controller finished 3 steps: max_wall_seconds=5 reached after 3 of 10 steps"
    assert snap.eta is None and snap.last_eval.accuracy == 0.625 and snap.first_eval.accuracy == 0.25
    assert all(p.alive is None and p.health is None for p in snap.processes)
    text = export(snap)
    assert "finished" in text and "the controller finished 3 steps" in text and "62.5% (version 3, at end)" in text


def test_a_run_whose_processes_all_exited_without_a_summary_ended(tmp_path, server):
    now = time.time()
    run = tmp_path / "run"
    build(run, server, now)
    table = json.loads((run / "processes.json").read_text())
    for name, e in table.items():
        e.update(state="exited", pid=dead_pid(), exit_code=1 if name == "trainer0" else -15,
                 ended=now - (30 if name == "trainer0" else 20))
    write_processes(str(run), table)
    snap = read_snapshot(str(run))
    assert (snap.state, snap.live) == ("ended", False)
    assert "trainer0 (exit code 1" in snap.note and "logs/trainer0.log" in snap.note
    assert all(p.health is None for p in snap.processes)  # a dead run's servers are not asked
    assert "ended" in export(snap) and not snap.note.startswith("failed")
    # The controller failed: the reason it recorded comes first.
    with open(run / "metrics.jsonl", "a") as f:
        f.write(row("failure", stop_reason={"kind": "failure", "message": "StalledRun: no train step in 6 s"}))
    snap = read_snapshot(str(run))
    assert snap.note.startswith("failed: StalledRun: no train step in 6 s; no summary, and none of its processes runs")
    # Recorded as running, but every pid is gone: the launcher died without recording their ends.
    for e in table.values():
        e.update(state="running", exit_code=None, ended=None)
    write_processes(str(run), table)
    snap = read_snapshot(str(run))
    assert (snap.state, snap.live) == ("ended", False) and "their launcher was killed?" in snap.note
    assert all(p.alive is False for p in snap.processes)


def test_without_a_process_table_liveness_comes_from_the_files_last_writes(tmp_path, server):
    now = time.time()
    run = tmp_path / "run"
    build(run, server, now)
    (run / "processes.json").unlink()
    snap = RunReader(str(run)).snapshot(now=now)
    assert (snap.state, snap.live) == ("running", True) and "no processes.json" in snap.note
    assert {p.name for p in snap.processes} == {"controller", "gen_server0", "rollout0", "reward0", "trainer0"}
    assert next(p for p in snap.processes if p.name == "gen_server0").health == "ok"
    old = now - 3600
    for path in [run / "metrics.jsonl", run / "ledger.jsonl", *(run / "logs").iterdir()]:
        os.utime(path, (old, old))
    snap = RunReader(str(run)).snapshot(now=now)
    assert (snap.state, snap.live) == ("ended", False) and "nothing written for 3600 s" in snap.note


def test_a_missing_or_foreign_directory_is_a_clear_error(tmp_path):
    with pytest.raises(NotARunDirectory, match=f"{tmp_path / 'nowhere'}: no such directory"):
        read_snapshot(str(tmp_path / "nowhere"))
    (tmp_path / "runs" / "a").mkdir(parents=True)
    (tmp_path / "runs" / "a" / "metrics.jsonl").write_text("")
    with pytest.raises(NotARunDirectory, match=r"runs is not a run directory.*holds run directories: a"):
        read_snapshot(str(tmp_path / "runs"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotARunDirectory, match="not a directory"):
        read_snapshot(str(tmp_path / "file"))


def test_a_run_still_preparing_shows_an_empty_view(tmp_path):
    (tmp_path / "run" / ".hydra").mkdir(parents=True)
    (tmp_path / "run" / ".hydra" / "config.yaml").write_text("total_steps: 5\n")
    (tmp_path / "run" / "launch.log").write_text("")
    snap = read_snapshot(str(tmp_path / "run"))
    assert (snap.state, snap.step, snap.trained_version, snap.loaded_version) == ("preparing", 0, None, None)
    assert "preparing" in export(snap)
