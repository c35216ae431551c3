"""The whole system: every process, real sockets, a real HTTP server, real HF files."""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from run_helpers import ANSWERS_SOME, SMALL, check_accounting, jsonl, launch, leftover_processes, run_processes, steps_of

pytestmark = pytest.mark.slow

BASE_MODELS = [ANSWERS_SOME]  # bootstrapped ahead by conftest.py (eta0_run)


def test_tiny_recipe_runs_asynchronously_end_to_end(tmp_path, run_cache):
    run_dir = tmp_path / "run"
    # The SMALL model answers nothing right, so every advantage is 0 and the train step would run
    # no answer: skipping is switched off here, where every phase of a step is timed.
    r = launch(run_dir, run_cache, "rollout.max_staleness=1", "rollout.keep_weights_every=2", "metrics.plot=true",
               "algorithm.skip_zero_advantage=false", "dump.every_steps=2")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = check_accounting(run_dir, eta=1)
    assert summary["steps"] == 4 and summary["trained_samples"] == 4 * 2 * 4
    steps = steps_of(run_dir)
    assert [m["step"] for m in steps] == [1, 2, 3, 4]
    assert max(m["staleness_max"] for m in steps) <= 1
    assert not any("train/kl_sum" in m for m in steps)  # no ref node in the recipe: no KL term
    # The control plane carries ids and sizes; the samples go rollout -> reward -> trainer.
    for m in steps[1:]:
        assert 0 < m["sent_bytes/controller"] < 3000, m
    samples_moved = sum(m["sent_bytes/reward0"] for m in steps)
    assert samples_moved > 5 * sum(m["sent_bytes/controller"] for m in steps)
    evals = [m for m in jsonl(run_dir / "metrics.jsonl") if m["event"] == "eval"]
    assert [e["when"] for e in evals] == ["start", "end"] and all(0 <= e["accuracy"] <= 1 for e in evals)
    assert "held-out accuracy before" in r.stdout and "trained samples" in r.stdout
    # Why it ended: in summary.json, on the console and in the summary table.
    assert summary["stop_reason"] == {"kind": "total_steps", "message": "total_steps=4 reached"}
    assert "run finished: total_steps=4 reached" in r.stdout and "why it ended" in r.stdout
    # The policy version advanced: the last published weights are v4, and generation used them;
    # v2 is kept besides the last two (keep_weights_every=2), v1 is not.
    assert sorted(p.name for p in (run_dir / "weights").iterdir() if p.name.startswith("v")) == ["v2", "v3", "v4"]
    # The step profile: the trainer's timed phases fit inside the controller's view of its step,
    # and each row's window holds its own step's training, the last row's too.
    assert all(0 < m["train_seconds"] <= m["step_seconds"] for m in steps), steps
    for m in steps:
        phases = [m[f"train/{p}_seconds"] for p in ("transport", "inputs", "packing", "forward", "backward",
                                                     "optimizer", "publish")]
        assert all(v > 0 for v in phases), m
        assert sum(phases) + m.get("train/wait_seconds", 0.0) <= m["train_seconds"] + m["step_seconds"], m
        assert sum(phases[2:6]) <= m["train/step_seconds"] + 1e-3  # the engine's own phases fit its step
    # The servers' compute counts per step: decode steps and prefills make up their busy time.
    for m in steps:
        busy = (1 - m["generator_idle"]) * m["step_seconds"]
        compute = m["gen/decode_seconds"] + m["gen/prefill_seconds"]
        assert 0.9 * busy - 1e-3 <= compute <= busy + 1e-6, m
        assert m["gen/decode_rows"] >= m["gen/decode_steps"] > 0, m
    assert sum(m["gen/prefill_tokens"] for m in steps) > 0
    assert all(m["train/skipped_tokens"] == 0 for m in steps)
    check_step_diagnostics(steps)
    check_dumps(run_dir, every=2, steps=4, samples_per_step=2 * 4, eta=1)
    profile = (run_dir / "profile.md").read_text()
    for phase in ("| trainer | forward |", "| trainer | optimizer |", "| trainer | idle |", "| generator | decode |",
                  "| generator | prefill |", "| generator | load weights |"):
        assert phase in profile
    assert (run_dir / "profile.png").stat().st_size > 1000
    # The checkpoint is a Hugging Face directory that transformers loads.
    from transformers import AutoModelForCausalLM

    from areal_flow.models.tokenizer import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(summary["checkpoint"])
    tok = load_tokenizer(summary["checkpoint"])
    assert model.config.vocab_size >= len(tok) and tok.decode(tok.encode("#### 12")) == "#### 12"
    assert (run_dir / "learning_curve.png").stat().st_size > 1000
    assert not leftover_processes(run_dir)


def check_step_diagnostics(steps: list[dict]) -> None:
    """Each step row's length-bias, staleness and behaviour-weight metrics (run_metrics.train_metrics)."""
    for m in steps:
        n = sum(m[f"by_length/samples/q{k}"] for k in range(1, 5))
        assert n == 2 * 4 and sum(m["staleness_seq_hist"]) == n, m
        for k in range(1, 5):  # every answer has a token in the loss: with the trainer ranks' sums added up,
            empty = m[f"by_length/samples/q{k}"] == 0  # a bucket has an advantage wherever it has answers
            assert (m[f"by_length/reward/q{k}"] is None) == empty == (m[f"by_length/advantage/q{k}"] is None), m
            assert f"by_length/loss_share/q{k}" in m, m
        shares = [m[f"by_length/loss_share/q{k}"] for k in range(1, 5)]
        assert all(s is None for s in shares) or sum(shares) == pytest.approx(1.0), m
        assert not any(k.startswith(("train/behav_weight_bin", "train/by_length")) for k in m)
        # Every answer token the loss ran (not skipped for all-zero advantages), in every minibatch and epoch.
        ran = m["train/n_valid_tokens"] - m["train/skipped_tokens"]
        if not ran:  # the loss ran on no micro-batch: it gave no statistics
            assert not any(k in m for k in ("train/behav_weight_hist", "train/capped_fraction", "train/ess_fraction"))
            continue
        hist, edges = m["train/behav_weight_hist"], m["train/behav_weight_hist_edges"]
        assert len(edges) == len(hist) + 1 and edges[0] == 0 and 5.0 in edges  # the recipe's cap
        assert sum(hist) == ran, m
        assert 0 <= m["train/capped_fraction"] <= 1 and 0 < m["train/ess_fraction"] <= 1 + 1e-9, m


def check_dumps(run_dir, every: int, steps: int, samples_per_step: int, eta: int, ranks: int = 1) -> None:
    """Every `every`-th step's trained samples in dumps/, one file per trainer rank, whole, as the
    ledger says they were trained (each group on one rank)."""
    dumped = sorted(p.name for p in (run_dir / "dumps").iterdir())
    assert dumped == [f"step-{s:08d}-rank{k}.jsonl" for s in range(every, steps + 1, every) for k in range(ranks)]
    trained = {e["step"]: sorted(e["groups"]) for e in jsonl(run_dir / "ledger.jsonl") if e["event"] == "train"}
    for s in range(every, steps + 1, every):
        per_rank = [jsonl(run_dir / "dumps" / f"step-{s:08d}-rank{k}.jsonl") for k in range(ranks)]
        groups = [{r["group_id"] for r in rows} for rows in per_rank]
        assert all(groups) and sum(map(len, groups)) == len(set().union(*groups))  # whole groups per rank
        records = [r for rows in per_rank for r in rows]
        assert len(records) == samples_per_step and all(r["step"] == s for r in records)
        assert sorted(set().union(*groups)) == trained[s - 1]
        for r in records:
            assert r["prompt"] and r["lengths"]["answer"] == len(r["advantages"]) >= 1, r
            assert sum(r["versions"].values()) == r["lengths"]["answer"] and 0 <= r["staleness"] <= eta, r
            assert r["staleness"] == s - 1 - min(int(v) for v in r["versions"]), r
            assert r["finish"] in ("stop", "length") and isinstance(r["reward"], float), r


def test_eta_zero_trains_each_batch_on_the_current_policy(eta0_run):
    # The session's η = 0 run (run_helpers.ETA0_RUN: 5 steps of 3 groups of 8), which
    # test_reproducible.py compares with a resumed one; a run of its own here cost ~15 s more.
    run_dir = eta0_run
    check_accounting(run_dir, eta=0, group_size=8)
    steps = [m for m in jsonl(run_dir / "metrics.jsonl") if m["event"] == "step"]
    assert len(steps) == 5 and all(m["staleness_max"] == 0 for m in steps)
    # Each row's window is its own step: generating the batch, then training it; none is a sliver
    # (the last row once covered only the final weight load).
    for m in steps:
        assert 0 < m["train_seconds"] <= m["step_seconds"] and m["generator_idle"] < 0.95, m
    ledger = jsonl(run_dir / "ledger.jsonl")
    admitted = {e["group"]: e["version"] for e in ledger if e["event"] == "admit"}
    # Synchronous: step s trains exactly the B groups admitted at version s.
    for e in (e for e in ledger if e["event"] == "train"):
        assert sorted(e["groups"]) == sorted(g for g, v in admitted.items() if v == e["step"])


def test_a_process_that_dies_stops_the_run_with_its_name_and_traceback(tmp_path, run_cache):
    # Start from a checkpoint whose weights file is corrupt: the model processes die loading it.
    from areal_flow.models.bootstrap import ensure_base_model

    base = ensure_base_model(str(tmp_path / "models"), steps=2, batch_size=4, progress=False)
    broken = tmp_path / "broken_model"
    shutil.copytree(base, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    run_dir = tmp_path / "dies"
    t0 = time.time()
    r = launch(run_dir, run_cache, f"model.path={broken}")
    assert r.returncode == 1
    out = r.stdout + r.stderr
    assert "run failed" in out and ("process 'gen_server0'" in out or "process 'trainer0'" in out)
    assert "Traceback (most recent call last)" in out
    assert time.time() - t0 < 120  # no hang
    assert not leftover_processes(run_dir)


def check_secured(run_dir, r) -> None:
    import msgspec

    from areal_flow.runtime.security import host_address
    from areal_flow.runtime.spec import RunSpec

    assert (run_dir / "spec.json").stat().st_mode & 0o777 == 0o600
    spec = msgspec.json.decode((run_dir / "spec.json").read_bytes(), type=RunSpec)
    assert spec.security is not None and spec.host == host_address()
    # The generation server bound the host's address (loopback here only if the host has no other).
    server_log = (run_dir / "logs" / "gen_server0.log").read_text()
    assert f"at http://{spec.host}:{spec.gen_ports[0]} (requests need the API key)" in server_log
    secrets = (spec.security.api_key, spec.security.client_secret, spec.security.server_secret)
    for text in [r.stdout, r.stderr, (run_dir / "config.yaml").read_text(),
                 *(p.read_text(errors="replace") for p in (run_dir / "logs").iterdir())]:
        assert not any(s in text for s in secrets), "a secret of the run was written outside spec.json"
    assert "secured: servers listen on" in r.stdout


def test_two_trainer_ranks_share_each_batch_and_train_it_once_in_a_secured_run(tmp_path, run_cache):
    """Data parallel over gloo: each rank trains its share of whole groups, none twice. The run is
    secured: every socket between the processes, the ranks' peer sockets among them, is CURVE, the
    servers listen on the host's address and take the API key, and no secret leaves spec.json."""
    run_dir = tmp_path / "dp"
    r = launch(run_dir, run_cache, "rollout.max_staleness=1", "eval_at_start=false", "cluster.n_devices=3",
               "launcher.pin_cpus=false", "graph.actor_prox.mesh=1-2", "graph.actor_train.mesh=1-2",
               "launcher.secure=true", "dump.every_steps=1")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    check_secured(run_dir, r)
    # The step's statistics summed over both ranks, and each rank's own samples dumped.
    check_step_diagnostics(steps_of(run_dir))
    check_dumps(run_dir, every=1, steps=4, samples_per_step=2 * 4, eta=1, ranks=2)
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


def test_a_frozen_generation_server_fails_the_run_naming_it_instead_of_hanging(tmp_path, run_cache):
    """SIGSTOP keeps a process alive and its sockets open, so nothing errors by itself: the
    controller's step_timeout must notice that no step completes and say what it waited for."""
    run_dir = tmp_path / "frozen"
    cmd = [sys.executable, "-m", "areal_flow.launch", *SMALL, f"cache_dir={run_cache}", f"hydra.run.dir={run_dir}",
           "total_steps=1000", "eval_at_start=false", "eval_at_end=false", "step_timeout=6", "launcher.stop_timeout=2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    try:
        deadline = time.time() + 150
        while not ((run_dir / "metrics.jsonl").exists() and steps_of(run_dir)):
            assert proc.poll() is None and time.time() < deadline, "the run never made a first step"
            time.sleep(0.5)
        frozen_at = time.time()
        os.kill(run_processes(run_dir)["gen_server0"], signal.SIGSTOP)
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out[-3000:]
    # The reason on one line of the console, the controller's exception named, and recorded as the run's.
    failed = next(line for line in out.splitlines() if line.startswith("run failed:"))
    assert failed.startswith("run failed: process 'controller' exited with code 1: StalledRun: no train step completed "
                             "within 6 s (step_timeout)") and "gen_server0 does not answer /health" in failed, failed
    ended = [m for m in jsonl(run_dir / "metrics.jsonl") if m["event"] == "failure"]
    assert [m["stop_reason"]["kind"] for m in ended] == ["failure"] and ended[0]["stop_reason"]["message"] in failed
    assert not (run_dir / "summary.json").exists()
    assert time.time() - frozen_at < 60
    assert not leftover_processes(run_dir)
