"""Exact reproduction: at η = 0 two runs with the same seeds train bit-identical weights.

The batches are the same groups (the controller takes them in group order), each sample draws from
its own seed (rollout/requests.py: group_seed), and the servers decode batch-invariantly, so a
sample's tokens and behaviour logprobs do not depend on which requests it was batched with."""

import json

import pytest
import torch
from run_helpers import ANSWERS_SOME, ETA0_RUN, jsonl, kill_trainer_after_checkpoint
from safetensors.torch import load_file
from test_resume_end_to_end import start

pytestmark = pytest.mark.slow

BASE_MODELS = [ANSWERS_SOME]  # bootstrapped ahead by conftest.py


def test_the_launcher_asks_for_batch_invariant_servers_at_eta_0():
    from areal_flow.config.schema import RolloutConfig, RunConfig
    from areal_flow.graph.placement import Proc
    from areal_flow.launchers.commands import server_command

    proc = Proc("gen_server0", "gen_server", (0,))
    synchronous, _ = server_command(RunConfig(rollout=RolloutConfig(max_staleness=0)), proc, "/m", 31000)
    assert "--enable-deterministic-inference" in synchronous


def test_a_run_killed_and_resumed_at_eta_0_trains_the_weights_of_one_never_stopped(tmp_path, run_cache, eta0_run):
    """Two runs with the same seeds: one uninterrupted (the session's eta0_run, which
    test_end_to_end.py also reads), one whose trainer is killed (kill -9) after its checkpoint of
    step 2 and which restarts itself from it (recover.retries). Both train the same groups and samples
    in the same steps and end with the same weights (to float rounding): runs reproduce, and a
    resume loses and changes nothing."""
    runs = [eta0_run, tmp_path / "b"]
    runs[1].mkdir()
    proc = start(runs[1], run_cache, *ETA0_RUN)
    out = kill_trainer_after_checkpoint(runs[1], proc, 2)  # before the checkpoint of step 4
    assert proc.returncode == 0 and "recover: restart 1 of 1" in out, out[-3000:]
    a, b = (load_file(run_dir / "checkpoint" / "model.safetensors") for run_dir in runs)
    assert a.keys() == b.keys()
    # Same weights to float rounding. On 2026-11-27 about one run in three on a loaded 2-core machine
    # ended 1.2e-7 apart (every tensor, resumed from step 2 or 4; the steps' groups, answers and
    # samples below identical): a rounding difference whose source is not found yet. A lost,
    # repeated or changed step moves the weights by about the learning rate (1e-4), far above 1e-6.
    assert [name for name in a if not torch.allclose(a[name], b[name], atol=1e-6, rtol=0)] == []
    base = load_file(json.loads((runs[0] / "spec.json").read_text())["model_path"] + "/model.safetensors")
    assert any(not torch.equal(a[name], base[name]) for name in base)  # the runs did train

    def story(run_dir):
        ledger = jsonl(run_dir / "ledger.jsonl")
        trained = [(e["step"], e["groups"]) for e in ledger if e["event"] == "train"]
        groups = {g for _, step_groups in trained for g in step_groups}
        lengths = {e["group"]: e["lengths"] for e in ledger if e["event"] == "finish" and e["group"] in groups}
        return trained, lengths, [r["uids"] for r in jsonl(run_dir / "trained-rank0.jsonl")]

    assert story(runs[0]) == story(runs[1])
    assert json.loads((runs[1] / "summary.json").read_text())["resumes"] == 1
