"""The whole system: every process, real sockets, a real HTTP server, real HF files."""

import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SMALL = [
    "total_steps=4", "algorithm.batch_size=2", "algorithm.group_size=4", "async.max_concurrent=8",
    "dataset.n_train=400", "dataset.n_eval=16", "model.bootstrap_steps=30", "model.bootstrap_batch_size=32",
    "max_wall_seconds=0", "launcher.start_timeout=90",
]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


def launch(run_dir: Path, cache: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "areal_flow.launch", *SMALL, f"cache_dir={cache}", f"hydra.run.dir={run_dir}", *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=run_dir.parent)


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def leftover_processes(run_dir: Path) -> list[int]:
    """Processes the launcher started for this run (it marks them with AREAL_FLOW_RUN) still alive."""
    marker = f"AREAL_FLOW_RUN={run_dir}".encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker in f.read().split(b"\0") and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z":
                    found.append(int(pid))
        except OSError:
            continue
    return found


def check_accounting(run_dir: Path, eta: int) -> dict:
    """Every admitted group is trained exactly once or still accounted for; staleness ≤ η."""
    ledger = jsonl(run_dir / "ledger.jsonl")
    admitted = {e["group"]: e["version"] for e in ledger if e["event"] == "admit"}
    trained_steps = {g: e["step"] for e in ledger if e["event"] == "train" for g in e["groups"]}
    finished = {e["group"] for e in ledger if e["event"] == "finish"}
    dropped = {e["group"] for e in ledger if e["event"] == "drop"}
    uids = [u for r in jsonl(run_dir / "trained-rank0.jsonl") for u in r["uids"]]
    assert len(uids) == len(set(uids)), "a sample was trained twice"
    groups_from_trainer = Counter(int(u.split("-")[0][1:]) for u in uids)
    assert set(groups_from_trainer) == set(trained_steps)
    assert all(n == 4 for n in groups_from_trainer.values())  # whole groups of group_size samples
    assert set(trained_steps) <= finished <= set(admitted)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["admitted_groups"] == len(admitted) and summary["trained_groups"] == len(trained_steps)
    assert summary["buffered_groups_at_end"] == len(finished - set(trained_steps))
    assert summary["dropped_groups"] == len(dropped) == 0
    running = set(admitted) - finished - dropped
    assert summary["running_groups_at_end"] == len(running)
    for g, step in trained_steps.items():
        assert step - admitted[g] <= eta, f"group {g} admitted at v{admitted[g]} trained at step {step}"
    return summary


def test_tiny_recipe_runs_asynchronously_end_to_end(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    r = launch(run_dir, cache_dir, "async.max_staleness=1")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = check_accounting(run_dir, eta=1)
    assert summary["steps"] == 4 and summary["trained_samples"] == 4 * 2 * 4
    steps = [m for m in jsonl(run_dir / "metrics.jsonl") if m["event"] == "step"]
    assert [m["step"] for m in steps] == [1, 2, 3, 4]
    assert max(m["staleness_max"] for m in steps) <= 1
    evals = [m for m in jsonl(run_dir / "metrics.jsonl") if m["event"] == "eval"]
    assert [e["when"] for e in evals] == ["start", "end"] and all(0 <= e["accuracy"] <= 1 for e in evals)
    assert "held-out accuracy before" in r.stdout and "trained samples" in r.stdout
    # The policy version advanced: the last published weights are v4, and generation used them.
    assert (run_dir / "weights" / "v4").is_dir()
    # The checkpoint is a Hugging Face directory that transformers loads.
    from transformers import AutoModelForCausalLM

    from areal_flow.models.tokenizer import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(summary["checkpoint"])
    tok = load_tokenizer(summary["checkpoint"])
    assert model.config.vocab_size >= len(tok) and tok.decode(tok.encode("#### 12")) == "#### 12"
    assert (run_dir / "learning_curve.png").stat().st_size > 1000
    assert not leftover_processes(run_dir)


def test_eta_zero_trains_each_batch_on_the_current_policy(tmp_path, cache_dir):
    run_dir = tmp_path / "sync"
    r = launch(run_dir, cache_dir, "async.max_staleness=0", "eval_at_start=false", "eval_at_end=false")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    check_accounting(run_dir, eta=0)
    steps = [m for m in jsonl(run_dir / "metrics.jsonl") if m["event"] == "step"]
    assert all(m["staleness_max"] == 0 for m in steps)
    ledger = jsonl(run_dir / "ledger.jsonl")
    admitted = {e["group"]: e["version"] for e in ledger if e["event"] == "admit"}
    # Synchronous: step s trains exactly the B groups admitted at version s.
    for e in (e for e in ledger if e["event"] == "train"):
        assert sorted(e["groups"]) == sorted(g for g, v in admitted.items() if v == e["step"])


def test_a_process_that_dies_stops_the_run_with_its_name_and_traceback(tmp_path, cache_dir):
    # Start from a checkpoint whose weights file is corrupt: the model processes die loading it.
    from areal_flow.models.bootstrap import ensure_base_model

    base = ensure_base_model(str(tmp_path / "models"), steps=2, batch_size=4, progress=False)
    broken = tmp_path / "broken_model"
    shutil.copytree(base, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    run_dir = tmp_path / "dies"
    t0 = time.time()
    r = launch(run_dir, cache_dir, f"model.path={broken}")
    assert r.returncode == 1
    out = r.stdout + r.stderr
    assert "run failed" in out and ("process 'gen_server0'" in out or "process 'trainer0'" in out)
    assert "Traceback (most recent call last)" in out
    assert time.time() - t0 < 120  # no hang
    assert not leftover_processes(run_dir)


def test_two_trainer_ranks_share_each_batch_and_train_it_once(tmp_path, cache_dir):
    """Data parallel over gloo: each rank trains its share of whole groups, none twice."""
    run_dir = tmp_path / "dp"
    r = launch(run_dir, cache_dir, "async.max_staleness=1", "eval_at_start=false", "cluster.n_devices=3",
               "launcher.pin_cpus=false", "graph.actor_prox.mesh=1-2", "graph.actor_train.mesh=1-2")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    per_rank = [jsonl(run_dir / f"trained-rank{k}.jsonl") for k in (0, 1)]
    for step in range(4):
        uids = [set(rows[step]["uids"]) for rows in per_rank]
        assert uids[0] and uids[1] and not uids[0] & uids[1]  # both ranks worked, on different samples
        groups = [{u.split("-")[0] for u in ids} for ids in uids]
        assert not groups[0] & groups[1]  # whole groups per rank
        assert len(uids[0] | uids[1]) == 2 * 4  # the batch: B groups × G samples
    ledger = jsonl(run_dir / "ledger.jsonl")
    trained = [g for e in ledger if e["event"] == "train" for g in e["groups"]]
    assert len(trained) == len(set(trained)) == 8
    assert (run_dir / "weights" / "v4").is_dir() and not leftover_processes(run_dir)
