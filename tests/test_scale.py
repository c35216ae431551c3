"""`python -m areal_flow.scale` on a live run (launchers/elastic.py): a generation server added while
the run trains serves the newest weights and takes requests; removed, it is drained and stopped;
the ledger's audit stays clean (no group lost, none trained twice, staleness within η). Commands
that cannot be carried out are refused by name and leave the run unchanged."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest
from run_helpers import RECIPE_ETA, SMALL, check_accounting, jsonl, steps_of, wait_for_step

from areal_flow.config.schema import ElasticConfig
from areal_flow.controller.ledger import audit
from areal_flow.generation.client.membership import read_membership
from areal_flow.launchers.autoscale import decide
from areal_flow.launchers.elastic import ScaleRefused, parse_change, submit, target_size
from areal_flow.runtime.spec import read_run

ELASTIC = ("cluster.n_devices=4", "launcher.pin_cpus=false", "eval_at_start=false", "eval_at_end=false",
           "total_steps=1000")


def scale(run_dir: Path, change: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "areal_flow.scale", str(run_dir), change, "--timeout", "120"],
                          capture_output=True, text=True, timeout=180)


def until(condition, proc: subprocess.Popen, timeout: float = 60.0) -> bool:
    """Whether `condition()` holds within `timeout` seconds, while the run `proc` goes on."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


class LiveRun:
    """A run of SMALL's sizes on ELASTIC's 4 devices, live inside `with`: `stop()` ends it with SIGTERM
    (a checkpoint at the end of its step) and returns its output; leaving the block kills it."""

    def __init__(self, tmp_path: Path, run_cache: Path, *overrides: str):
        self.run_dir = tmp_path / "run"
        self.run_dir.mkdir()
        self.proc = subprocess.Popen([sys.executable, "-m", "areal_flow.launch", *SMALL, f"cache_dir={run_cache}",
                                      f"hydra.run.dir={self.run_dir}", *ELASTIC, *overrides],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)

    def __enter__(self) -> LiveRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.kill()

    def stop(self) -> str:
        """Stop the run: it ends as stopped (130), nothing restarted, nothing failed; its output."""
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=120)
        assert self.proc.returncode == 130, out[-3000:]
        assert "restarted, the run goes on" not in out and "run failed" not in out
        return out


def generated_tokens(url: str) -> int:
    with urllib.request.urlopen(url + "/server_info", timeout=5) as answer:
        info = json.load(answer)
    return sum(s.get("generated_tokens", 0) for s in info["internal_states"])


@pytest.mark.slow
def test_a_server_added_to_a_live_run_serves_and_one_removed_drains_with_the_ledger_clean(tmp_path, run_cache):
    with LiveRun(tmp_path, run_cache) as run:
        run_dir, proc = run.run_dir, run.proc
        wait_for_step(run_dir, 1, proc)
        up = scale(run_dir, "generate=+1")
        assert up.returncode == 0, up.stdout + up.stderr
        assert "added gen_server1: healthy after" in up.stdout
        membership = read_membership(str(run_dir))
        assert membership.serving() == ["gen_server0", "gen_server1"]
        url = membership.servers["gen_server1"].url
        # Refused by name, the run unchanged: too many devices, a size below 1, a role that is not one.
        beyond = scale(run_dir, "generate=+3")
        assert beyond.returncode == 2 and "needs 3 free device(s)" in beyond.stdout and "free: 3 of 4" in beyond.stdout
        below = scale(run_dir, "generate=-2")
        assert below.returncode == 2 and "would leave 0 generation server(s) of 2" in below.stdout
        role = scale(run_dir, "critic=+1")
        assert role.returncode == 2 and "there is no role 'critic' to scale" in role.stdout
        assert until(lambda: generated_tokens(url) > 0, proc)  # the new server took requests
        down = scale(run_dir, "generate=-1")
        assert down.returncode == 0, down.stdout + down.stderr
        assert "removed gen_server1" in down.stdout
        assert read_membership(str(run_dir)).serving() == ["gen_server0"]
        wait_for_step(run_dir, len(steps_of(run_dir)) + 2, proc)
        run.stop()
    processes = json.loads((run_dir / "processes.json").read_text())
    assert processes["gen_server1"]["state"] == "removed" and processes["gen_server1"]["ended"]
    check_accounting(run_dir, eta=RECIPE_ETA)  # no group lost, none trained twice, staleness within η
    audit_ = audit(str(run_dir / "ledger.jsonl"), RECIPE_ETA)
    assert audit_["problems"] == [] and audit_["scales"] == 4  # the controller recorded each change
    scales = [e for e in jsonl(run_dir / "ledger.jsonl") if e["event"] == "scale"]
    assert [next(k for k in ("added", "joined", "leaving", "removed") if e[k] == ["gen_server1"]) for e in scales] \
        == ["added", "joined", "leaving", "removed"]
    after = scale(run_dir, "generate=+1")
    assert after.returncode == 2 and "is not running" in after.stdout


@pytest.mark.slow
def test_a_judge_server_added_to_a_live_run_answers_and_one_removed_drains(tmp_path, run_cache):
    with LiveRun(tmp_path, run_cache, "recipe=tiny_arith_judge") as run:
        run_dir, proc = run.run_dir, run.proc
        wait_for_step(run_dir, 1, proc)
        up = scale(run_dir, "judge=+1")
        assert up.returncode == 0, up.stdout + up.stderr
        assert "added judge_server1: healthy after" in up.stdout
        membership = read_membership(str(run_dir), "judge")
        assert membership.serving() == ["judge_server0", "judge_server1"]
        assert read_membership(str(run_dir)).serving() == ["gen_server0"]  # the policy's servers unchanged
        named = scale(run_dir, "judge:critic=+1")
        assert named.returncode == 2 and "this run has no judge 'critic' (its judges: judge)" in named.stdout
        below = scale(run_dir, "judge=-2")
        assert below.returncode == 2 and "would leave 0 judge server(s) of 2" in below.stdout
        # The rollout workers' judge pools take it at their next health check (rollout.health_interval).
        assert until(lambda: generated_tokens(membership.servers["judge_server1"].url) > 0, proc)
        down = scale(run_dir, "judge:judge=-1")
        assert down.returncode == 0, down.stdout + down.stderr
        assert "removed judge_server1" in down.stdout
        wait_for_step(run_dir, len(steps_of(run_dir)) + 2, proc)
        run.stop()
    check_accounting(run_dir, eta=RECIPE_ETA)
    scales = [e for e in jsonl(run_dir / "ledger.jsonl") if e["event"] == "scale"]
    assert [(e["judge"], next(k for k in ("added", "leaving", "removed") if e[k])) for e in scales] \
        == [("judge", "added"), ("judge", "leaving"), ("judge", "removed")]
    assert json.loads((run_dir / "processes.json").read_text())["judge_server1"]["state"] == "removed"


@pytest.mark.slow
def test_the_autoscaler_adds_a_server_and_the_trainer_resized_trains_on_from_its_checkpoints(tmp_path, run_cache):
    # The autoscaler adds a server as soon as the trainer waits at all, up to 2; then the trainer is
    # resized 1 -> 2 -> 1 by hand on the device left.
    with LiveRun(tmp_path, run_cache, "elastic.auto=true", "elastic.window_steps=2", "elastic.add_above_trainer_idle=0",
                 "elastic.max_servers=2") as run:
        run_dir, proc = run.run_dir, run.proc
        assert until(lambda: (run_dir / "scale" / "results.jsonl").exists(), proc, timeout=240)
        up = scale(run_dir, "trainers=2")
        assert up.returncode == 0, up.stdout + up.stderr
        assert "trainer ranks 1 -> 2: checkpoint of step" in up.stdout
        assert read_run(str(run_dir))[1].n_trainers == 2
        beyond = scale(run_dir, "trainers=5")
        assert beyond.returncode == 2 and "needs 5 device(s) (one a rank); the trainer holds 1, 3 and free are none" \
            in beyond.stdout, beyond.stdout
        below = scale(run_dir, "trainers=-2")
        assert below.returncode == 2 and "would leave 0 trainer rank(s) of 2" in below.stdout
        wait_for_step(run_dir, len(steps_of(run_dir)) + 2, proc)
        assert jsonl(run_dir / "trained-rank1.jsonl")  # the new rank trained its share
        down = scale(run_dir, "trainers=1")
        assert down.returncode == 0, down.stdout + down.stderr
        assert "trainer ranks 2 -> 1" in down.stdout
        trained = len(jsonl(run_dir / "trained-rank1.jsonl"))
        wait_for_step(run_dir, len(steps_of(run_dir)) + 2, proc)
        assert len(jsonl(run_dir / "trained-rank1.jsonl")) == trained  # rank 1 is gone
        out = run.stop()
    decisions = jsonl(run_dir / "scale" / "decisions.jsonl")
    assert [d["change"] for d in decisions] == ["+1"]  # then max_servers holds it at 2
    assert len(decisions[0]["figures"]["trainer_idle"]) == 2 and decisions[0]["figures"]["servers"] == 1
    assert "autoscaler: generate=+1: the trainer waited on samples" in out
    done = jsonl(run_dir / "scale" / "results.jsonl")
    assert done[0]["command"] == "generate=+1" and done[0]["added"] == ["gen_server1"] and done[0]["ok"]
    check_accounting(run_dir, eta=RECIPE_ETA)  # no group lost, none trained twice, staleness within η
    resizes = [e["trainers"] for e in jsonl(run_dir / "ledger.jsonl") if e["event"] == "scale" and "trainers" in e]
    assert resizes == [{"from": 1, "to": 2}, {"from": 2, "to": 1}]
    processes = json.loads((run_dir / "processes.json").read_text())
    assert processes["trainer1"]["state"] == "removed" and processes["trainer0"]["restarts"] == 0


@pytest.mark.parametrize("change, message", [
    ("+x", "a size is N, +N or -N"),
    ("-3", "it would leave -1 generation server(s) of 2"),
    ("0", "it would leave 0 generation server(s)"),
    ("2", "the run has 2 generation server(s) already"),
])
def test_a_size_that_cannot_be_is_refused_naming_it(change, message):
    with pytest.raises(ScaleRefused, match=re.escape(message)):
        target_size("generate", change, 2)


def test_sizes_read_as_changes_or_totals():
    assert parse_change("generate", "+2") == ("add", 2) and parse_change("generate", "-1") == ("add", -1)
    assert parse_change("generate", "4") == ("set", 4) and target_size("generate", "4", 1) == 4


def test_one_scale_at_a_time_and_a_run_that_is_not_running_is_refused(tmp_path, capsys):
    from areal_flow.scale import main

    first = submit(str(tmp_path), "generate", "+1")
    with pytest.raises(ScaleRefused, match=r"another scale command is in progress \(generate=\+1, since"):
        submit(str(tmp_path), "generate", "-1")
    assert first.text == "generate=+1"
    (tmp_path / "spec.json").write_text("{}")
    assert main([str(tmp_path), "generate=+1"]) == 2
    assert "is not running (no launcher holds it)" in capsys.readouterr().out
    assert main([str(tmp_path / "nothing"), "generate=+1"]) == 2
    assert "is not a run directory" in capsys.readouterr().out


@pytest.mark.parametrize("overrides, n, message", [
    (["recipe=tiny_arith_megatron", "training.distributed_optimizer=true"], 2,
     "graph.actor_prox.engine=megatron with training.distributed_optimizer=true keeps each rank's shard"),
    (["recipe=tiny_arith_megatron"], 2, None),
    (["recipe=tiny_arith_megatron", "graph.actor_prox.mesh=1-2", "graph.actor_train.mesh=1-2",
      "graph.actor_prox.parallel=t2", "graph.actor_train.parallel=t2", "cluster.n_devices=3"], 1,
     "graph.actor_train.parallel has tp=2, pp=1: only a data-parallel trainer resizes"),
    (["recipe=tiny_arith_ref"], 2, "node(s) ref run on a mesh of their own"),
    (["graph.generate.mesh=1"], 2, "generation and training share devices (colocated)"),
    (["algorithm.n_minibatches=2"], 2, "algorithm.n_minibatches=2 exceeds the 1 prompt group(s) a rank gets"),
    (["algorithm.n_minibatches=2"], 1, None),
    ([], 3, None),
])
def test_a_trainer_that_cannot_change_its_size_is_named(overrides, n, message):
    from hydra import compose, initialize_config_dir

    from areal_flow.launch import CONF_DIR
    from areal_flow.run.start import resize_problem
    from areal_flow.runtime.spec import typed

    with initialize_config_dir(str(CONF_DIR), version_base=None):
        cfg = typed(compose("config", overrides=["output_dir=/tmp/unused", "algorithm.batch_size=2", *overrides]))
    problem = resize_problem(cfg, n)
    assert problem is None if message is None else message in problem, problem


def rows(trainer_idle: list[float], generator_idle: list[float | None]) -> list[dict]:
    return [{"step": i + 1, "trainer_idle": w, "generator_idle": g} for i, (w, g) in enumerate(zip(trainer_idle, generator_idle))]


AUTO = ElasticConfig(auto=True, window_steps=3, add_above_trainer_idle=0.3, remove_above_generator_idle=0.5)


def test_the_autoscaler_adds_a_server_while_the_trainer_waits_and_devices_are_free():
    waiting = rows([0.6, 0.5, 0.7], [0.0, 0.1, 0.0])
    decision = decide(waiting, AUTO, servers=1, free=2, per_server=1)
    assert decision.change == "+1" and "waited on samples more than 30% of each of the last 3 steps" in decision.why
    assert decision.figures == {"steps": [1, 2, 3], "trainer_idle": [0.6, 0.5, 0.7], "generator_idle": [0.0, 0.1, 0.0],
                                "servers": 1, "free_devices": 2}
    assert decide(waiting, AUTO, servers=1, free=0, per_server=1) is None  # no device free
    assert decide(waiting, AUTO, servers=1, free=1, per_server=2) is None  # a server needs 2 (tp_size)
    assert decide(waiting, replace(AUTO, max_servers=1), servers=1, free=2, per_server=1) is None
    assert decide(rows([0.6, 0.2, 0.7], [0.0] * 3), AUTO, servers=1, free=2, per_server=1) is None  # not every step
    assert decide(waiting[1:], AUTO, servers=1, free=2, per_server=1) is None  # fewer steps than the window


def test_the_autoscaler_removes_a_server_while_generation_outruns_the_staleness_bound():
    ahead = rows([0.1, 0.0, 0.2], [0.8, 0.7, 0.9])
    decision = decide(ahead, AUTO, servers=2, free=0, per_server=1)
    assert decision.change == "-1" and "idled more than 50% of each of the last 3 steps" in decision.why
    assert decide(ahead, AUTO, servers=1, free=0, per_server=1) is None  # the last server stays
    assert decide(rows([0.1, 0.0, 0.2], [0.8, None, 0.9]), AUTO, servers=2, free=0, per_server=1) is None  # SGLang: unknown


def test_a_server_that_fails_to_start_is_reported_and_left_out_and_the_run_goes_on(tmp_path):
    from areal_flow.graph.placement import Proc
    from areal_flow.launchers.elastic import Scaler, results
    from areal_flow.launchers.local import LocalLauncher

    run = str(tmp_path)
    launcher = LocalLauncher(run, stop_timeout=2)
    launcher.start(Proc("controller", "controller"), [sys.executable, "-c", "import time; time.sleep(60)"])
    Scaler.reset(run, {"gen_server0": "http://127.0.0.1:9"})
    broken = [sys.executable, "-c", "import sys; print('no model here'); sys.exit(1)"]  # a server that cannot start
    scaler = Scaler(launcher, run, command=lambda proc, port, host: (broken, {}), n_devices=2, per_server=1,
                    followers=[], weight_mode="disk", restarts=0, start_timeout=30)
    submit(run, "generate", "+1")
    deadline = time.monotonic() + 30
    try:
        while not results(run):
            scaler.tick()
            assert not launcher.check("controller")  # its death is the scale's failure, not the run's
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        launcher.stop_all()
    (out,) = results(run)
    assert out["ok"] is False and out["added"] == [] and list(out["failed"]) == ["gen_server1"]
    assert out["failed"]["gen_server1"].startswith("it exited with code 1 while starting; its log: ")
    assert "no model here" in open(out["failed"]["gen_server1"].split("its log: ")[1]).read()
    assert read_membership(run).serving() == ["gen_server0"] and "gen_server1" not in launcher.children
    assert json.loads((tmp_path / "processes.json").read_text())["gen_server1"]["state"] == "removed"
    assert not (tmp_path / "scale" / "request.json").exists()  # the next command may come
