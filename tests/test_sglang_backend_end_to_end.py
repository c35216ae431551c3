"""generation.backend=sglang end to end: the launcher starts `python -m sglang.launch_server` as it
would on a GPU cluster, here the test-only stand-in (tests/generation/sglang_standin), which parses
SGLang's flags, records them, and answers as real SGLang does where it differs from the embedded
server (no per-token versions, no busy_seconds, no text)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from run_helpers import TRAIN_EVERY_GROUP, check_accounting, launch, launch_recipe, leftover_processes, steps_of

pytestmark = pytest.mark.slow

STANDIN = Path(__file__).resolve().parent / "generation" / "sglang_standin"


def pair(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_the_tiny_recipe_trains_on_sglang_servers_started_with_the_mapped_flags(tmp_path, run_cache, monkeypatch):
    record = tmp_path / "sglang_argv.jsonl"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(STANDIN), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("SGLANG_STANDIN_RECORD", str(record))
    run_dir = tmp_path / "run"
    r = launch(run_dir, run_cache, "generation.backend=sglang", "generation.mem_fraction_static=0.5",
               "generation.max_batch_size=32", "generation.max_total_tokens=8192", "generation.disable_radix_cache=true",
               "generation.extra_args=[--log-level,warning]", "total_steps=3", "eval_at_start=false",
               "rollout.max_staleness=1", "rollout.interrupt=true", "seed=5")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]

    servers = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(servers) == 1  # one server on the generate mesh "0"
    argv, spec = servers[0]["argv"], json.loads((run_dir / "spec.json").read_text())
    assert pair(argv, "--model-path") == spec["model_path"] and pair(argv, "--port") == str(spec["gen_ports"][0])
    assert pair(argv, "--host") == "127.0.0.1" and pair(argv, "--tp-size") == "1"
    assert pair(argv, "--random-seed") == "5" and pair(argv, "--device") == "cpu"
    assert pair(argv, "--mem-fraction-static") == "0.5" and pair(argv, "--max-running-requests") == "32"
    assert pair(argv, "--max-total-tokens") == "8192"
    assert "--skip-tokenizer-init" in argv and "--disable-radix-cache" in argv
    assert argv[-2:] == ["--log-level", "warning"]
    # The server owns core 0: pinned there, and SGLang's CPU engine binds its threads there too.
    assert servers[0]["cores"] == [0]
    assert servers[0]["env"] == {"SGLANG_USE_CPU_ENGINE": "1", "SGLANG_CPU_OMP_THREADS_BIND": "0"}

    summary = check_accounting(run_dir, eta=1)
    steps = steps_of(run_dir)
    assert summary["steps"] == 3 and [m["step"] for m in steps] == [1, 2, 3]
    # Token versions came from meta_info.weight_version (SGLang has no per-token versions; had they
    # all read 0, step 3 would show staleness 2 or more), and the generator's busy time is unknown
    # (SGLang reports none): the run copes with both.
    assert all(m["staleness_max"] <= 1 and m.get("generator_idle") is None for m in steps)
    assert not leftover_processes(run_dir)


def test_dry_run_prints_the_sglang_command_lines(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "areal_flow.launch", "dry_run=true", "generation.backend=sglang", "generation.tp_size=2",
         "cluster.n_devices=4", "launcher.pin_cpus=false", "graph.generate.mesh=0-1", "graph.actor_prox.mesh=2-3",
         "graph.actor_train.mesh=2-3", "generation.dtype=bfloat16", "generation.extra_args=[--log-level,warning]"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "gen_server0    core 0,1" in r.stdout and "gen_server1" not in r.stdout
    line = next(x for x in r.stdout.splitlines() if x.strip().startswith("gen_server0: "))
    assert "SGLANG_USE_CPU_ENGINE=1" in line and f"{sys.executable} -m sglang.launch_server --model-path" in line
    assert "--tp-size 2 --random-seed 1 --device cpu --skip-tokenizer-init --dtype bfloat16 --log-level warning" in line


def test_bad_generation_settings_stop_the_run_naming_the_keys(tmp_path):
    r = subprocess.run([sys.executable, "-m", "areal_flow.launch", "generation.backend=vllm", "generation.tp_size=3"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "generation.backend='vllm' must be one of embedded, sglang" in r.stdout
    assert "generation.tp_size=3 does not divide the 1 device(s) of the generate mesh" in r.stdout


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed here")
def test_a_missing_sglang_package_fails_at_start_with_the_install_command(tmp_path):
    r = subprocess.run([sys.executable, "-m", "areal_flow.launch", "generation.backend=sglang",
                        f"hydra.run.dir={tmp_path / 'run'}", f"cache_dir={tmp_path / 'cache'}"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "the sglang package is not installed" in r.stdout and "pip install -e '.[sglang]'" in r.stdout
    assert not (tmp_path / "cache").exists()  # found before the data and the model are prepared


def test_an_agent_recipe_trains_through_the_gateway_on_sglang_servers_with_their_tokenizer(tmp_path, run_cache,
                                                                                           monkeypatch):
    pytest.importorskip("openai")
    record = tmp_path / "sglang_argv.jsonl"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(STANDIN), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("SGLANG_STANDIN_RECORD", str(record))
    run_dir = tmp_path / "agent"
    r = launch_recipe(run_dir, run_cache, "tiny_arith_agent", "generation.backend=sglang", "eval_at_start=false",
                      "total_steps=2", TRAIN_EVERY_GROUP, "model.bootstrap_steps=5", "rollout.interrupt=true")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (server,) = [json.loads(line) for line in record.read_text().splitlines()]
    assert "--skip-tokenizer-init" not in server["argv"]  # chat templates are SGLang's to render
    check_accounting(run_dir, eta=2)
    for m in steps_of(run_dir):  # the calls' tokens came back from SGLang's fields, linked without drift
        assert m["agent/drift_rate"] == 0 and m["agent/calls"] >= 1 and m["agent/failed_runs"] == 0
