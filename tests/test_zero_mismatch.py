"""training.zero_mismatch end to end: the trainer's π_prox equals the servers' π_behav bit for bit on
every token the current weights sampled (issue 67, item 4).

At η = 0 that is every trained token: the step's mismatch figures read 0, and the dumped
prox_logprobs equal behav_logprobs, where Hugging Face's own forward differs in the last bits (the
equality is the mode's doing, not a coincidence of the model), and the replay agrees. At η = 1 with interrupts, the
tokens of the step's own version, those of answers cut by an update and continued included, are
equal too."""

import subprocess
import sys

import numpy as np
import pytest
import torch
from run_helpers import ANSWERS_SOME, jsonl, launch, steps_of
from test_logprob_audit import load, recomputed

pytestmark = pytest.mark.slow

BASE_MODELS = [ANSWERS_SOME]  # bootstrapped ahead by conftest.py
COMMON = (*ANSWERS_SOME, "training.zero_mismatch=true", "eval_at_start=false", "eval_at_end=false",
          "dump.every_steps=1", "dump.tokens=true")


def dumped(run_dir):
    return [rec for dump in sorted((run_dir / "dumps").glob("step-*.jsonl")) for rec in jsonl(dump)]


def test_at_eta_0_every_trained_token_has_prox_equal_to_behav(tmp_path, run_cache):
    run_dir = tmp_path / "run"
    result = launch(run_dir, run_cache, *COMMON, "rollout.max_staleness=0", "total_steps=4", "dump.weights=true")
    assert result.returncode == 0, result.stderr[-3000:]
    steps = steps_of(run_dir)
    assert len(steps) == 4
    for s in steps:  # the prox node ran every step (a shortcut would be exact here too: the mode runs it)
        assert s["train/mismatch/tokens"] > 0 and s["train/mismatch/abs_max"] == 0.0, s
        assert s["train/prox_seconds"] > 0
    model = load(run_dir / "dumps" / "weights" / "v00000000")
    tokens = hf_differs = 0
    for rec in dumped(run_dir):
        a = rec["arrays"]
        behav, prox = np.float32(a["behav_logprobs"]), np.float32(a["prox_logprobs"])
        assert np.array_equal(prox, behav), rec["uid"]
        tokens += len(behav)
        if rec["step"] == 1:
            with torch.no_grad():
                hf_differs += int((recomputed(model, a["prompt_ids"], a["output_ids"], 1.0) != behav).sum())
    assert tokens > 0 and hf_differs > 0
    # The replay recomputes π_prox the same way: every step's weights as the run's.
    replayed = subprocess.run([sys.executable, "-m", "areal_flow.replay", str(run_dir)], capture_output=True, text=True,
                              timeout=300)
    assert replayed.returncode == 0 and "all 4 steps equal" in replayed.stdout, replayed.stdout[-2000:]


def test_with_interrupts_the_current_versions_tokens_match_cut_answers_included(tmp_path, run_cache):
    run_dir = tmp_path / "run"
    # One group a step: a step is shorter than an answer, so updates cut answers, and at η = 1 those
    # that go on under the new weights are trained by the step that starts from them.
    result = launch(run_dir, run_cache, *COMMON, "algorithm.batch_size=1", "rollout.max_staleness=1",
                    "rollout.interrupt=true", "generation.deterministic=true", "rollout.max_concurrent=16",
                    "total_steps=12")
    assert result.returncode == 0, result.stderr[-3000:]
    current = continued = 0
    for rec in dumped(run_dir):
        a = rec["arrays"]
        versions = np.asarray(a["versions"])
        mine = versions == rec["step"] - 1  # the weights the step started from: π_prox
        behav, prox = np.float32(a["behav_logprobs"]), np.float32(a["prox_logprobs"])
        assert np.array_equal(prox[mine], behav[mine]), (rec["step"], rec["uid"])
        current += int(mine.sum())
        continued += int(mine.any() and len(set(versions.tolist())) > 1 and mine[-1] and not mine[0])
    assert current > 0 and continued > 0, (current, continued)
