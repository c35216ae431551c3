"""Bad input as a careless user types it: each is refused in one line naming the key or file,
before anything starts (issue 43, part 6)."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


def launch(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "areal_flow.launch", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_a_group_larger_than_the_server_takes_is_refused_naming_the_key_and_the_limit():
    from areal_flow.config.schema import AlgorithmConfig, RunConfig
    from areal_flow.generation.limits import MAX_N
    from areal_flow.run import checks

    too_many = RunConfig(algorithm=AlgorithmConfig(group_size=100000))
    assert f"algorithm.group_size=100000 exceeds the generation server's limit of {MAX_N} samples per prompt " \
           "(sampling_params.n)" in checks._rollout(too_many)
    assert not any("group_size" in p for p in checks._rollout(RunConfig(algorithm=AlgorithmConfig(group_size=MAX_N))))


def test_a_run_dir_that_cannot_be_made_is_one_line_naming_the_key(tmp_path):
    from areal_flow.launch import check_run_dir

    r = launch("hydra.run.dir=/proc/nope/run", cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip() == "error: hydra.run.dir='/proc/nope/run': cannot make the directory (No such file or directory)"
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert check_run_dir(["dry_run=true", f"hydra.sweep.dir={blocker}/run"]) == \
        f"hydra.sweep.dir='{blocker}/run': cannot make the directory (Not a directory)"
    assert check_run_dir([f"hydra.run.dir={tmp_path}/a/b"]) is None and (tmp_path / "a" / "b").is_dir()


def test_a_model_directory_without_tokenizer_files_names_the_missing_files(tmp_path):
    from areal_flow.config.schema import ModelConfig, RunConfig
    from areal_flow.models.tokenizer import build_char_tokenizer
    from areal_flow.run import checks

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen2"}')
    cfg = RunConfig(model=ModelConfig(path=str(model)))
    assert f"model.path='{model}' has no tokenizer: missing tokenizer.json, tokenizer_config.json (save the model's " \
           "tokenizer into that directory with save_pretrained)" in checks._machine(cfg)
    build_char_tokenizer().save_pretrained(str(model))
    assert not any("tokenizer" in p for p in checks._machine(cfg))


@pytest.mark.slow  # a real launcher that imports torch and starts a bootstrap
def test_ctrl_c_during_the_bootstrap_exits_130_in_one_line_and_caches_no_partial_model(tmp_path):
    cache = tmp_path / "cache"
    cmd = [sys.executable, "-m", "areal_flow.launch", f"cache_dir={cache}", f"hydra.run.dir={tmp_path / 'run'}",
           "dataset.n_train=40", "dataset.n_eval=8", "model.bootstrap_steps=100000"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    models = cache / "models"
    deadline = time.monotonic() + 120
    try:
        # The temporary directory appears once torch is imported and training is about to start.
        while not (models.is_dir() and any(p.name.startswith(".tmp-") for p in models.iterdir())):
            assert proc.poll() is None and time.monotonic() < deadline, "the bootstrap never started"
            time.sleep(0.2)
        time.sleep(2)  # into its training steps
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()  # a launcher that ignored the signal would train on through the rest of the suite
    assert proc.returncode == 130, out + err
    assert "Traceback" not in out + err
    assert "interrupted before the run started: nothing half-made was cached" in out
    # Only the bootstrap's lock file stays: no model directory, finished or not, a later run could take.
    assert [p.name for p in models.iterdir() if not p.name.endswith(".lock")] == []
