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
import urllib.request
from pathlib import Path

import pytest
from run_helpers import RECIPE_ETA, SMALL, check_accounting, jsonl, steps_of, wait_for_step

from areal_flow.controller.ledger import audit
from areal_flow.generation.membership import read_membership
from areal_flow.launchers.elastic import ScaleRefused, parse_change, submit, target_size

ELASTIC = ("cluster.n_devices=4", "launcher.pin_cpus=false", "eval_at_start=false", "eval_at_end=false",
           "total_steps=1000")


def scale(run_dir: Path, change: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "areal_flow.scale", str(run_dir), change, "--timeout", "120"],
                          capture_output=True, text=True, timeout=180)


def generated_tokens(url: str) -> int:
    with urllib.request.urlopen(url + "/server_info", timeout=5) as answer:
        info = json.load(answer)
    return sum(s.get("generated_tokens", 0) for s in info["internal_states"])


@pytest.mark.slow
def test_a_server_added_to_a_live_run_serves_and_one_removed_drains_with_the_ledger_clean(tmp_path, run_cache):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "areal_flow.launch", *SMALL, f"cache_dir={run_cache}",
                             f"hydra.run.dir={run_dir}", *ELASTIC],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    try:
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
        steps = len(steps_of(run_dir))
        wait_for_step(run_dir, steps + 2, proc)
        assert generated_tokens(url) > 0  # the new server took requests
        down = scale(run_dir, "generate=-1")
        assert down.returncode == 0, down.stdout + down.stderr
        assert "removed gen_server1" in down.stdout
        assert read_membership(str(run_dir)).serving() == ["gen_server0"]
        wait_for_step(run_dir, len(steps_of(run_dir)) + 2, proc)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, out[-3000:]
    assert "restarted, the run goes on" not in out and "run failed" not in out
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
