"""Shared pieces of the benchmark scripts: the machine line, running a recipe, reading its results."""

from __future__ import annotations

import atexit
import json
import os
import platform
import subprocess
import sys
import tempfile

import torch

from areal_flow.metrics.writer import read_metrics


# What the throughput benchmarks run: training alone, no wall-time limit, no plots. The recipe's
# held-out evaluation beside training (eval.every_versions: 25) holds the generation servers at its
# version for 2-3 s on two cores, and the step windows count that time; until 25b1b38 the
# evaluation paused the run's clock instead and no step window held it. Left in, it cost
# bench_async's η = 4 side 15-25% of its trained samples/s (docs/benchmarks.md, "Asynchronous
# against synchronous").
TRAINING_ONLY = ["eval_at_start=false", "eval_at_end=false", "eval.every_versions=0", "max_wall_seconds=0",
                 "metrics.plot=false"]


def machine() -> str:
    cpu = "unknown cpu"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{os.cpu_count()} cores ({cpu}), {gpu}, Python {platform.python_version()}, torch {torch.__version__}"


def run_recipe(run_dir: str, overrides: list[str], tree: str | None = None) -> tuple[dict, list[dict]]:
    """Run `python -m areal_flow.launch` into run_dir; returns (summary, metrics). `tree`: run that
    checkout's code (its folder the working directory, first on sys.path) instead of the installed one."""
    # Speed comparisons run every η with the same decoding: batch-invariant decoding, on by default
    # at η = 0 for reproducibility, costs about a fifth of the tokens/s (docs/generation.md).
    fixed = [] if any(o.startswith("generation.deterministic=") for o in overrides) else ["generation.deterministic=false"]
    cmd = [sys.executable, "-m", "areal_flow.launch", *fixed, *overrides, f"hydra.run.dir={run_dir}"]
    print("$", " ".join(cmd[1:]), f"(in {tree})" if tree else "", flush=True)
    env = None if tree is None else {**os.environ, "PYTHONPATH": tree}
    subprocess.run(cmd, check=True, cwd=tree, env=env)
    return read_run_dir(run_dir)


def worktree(rev: str, prefix: str = "bench_") -> str:
    """A checkout of `rev` in a temporary folder (git worktree), removed at exit."""
    path = tempfile.mkdtemp(prefix=prefix)
    subprocess.run(["git", "worktree", "add", "--detach", path, rev], check=True, capture_output=True)
    atexit.register(subprocess.run, ["git", "worktree", "remove", "--force", path], capture_output=True)
    return path


def read_run_dir(run_dir: str) -> tuple[dict, list[dict]]:
    """A finished run's (summary, metrics)."""
    with open(os.path.join(run_dir, "summary.json")) as f:
        return json.load(f), read_metrics(os.path.join(run_dir, "metrics.jsonl"))


def timed_steps(metrics: list[dict]) -> tuple[list[dict], float]:
    """A run's step rows without the first (it includes start-up), and the wall seconds they span:
    each row's window runs from the end of the previous step's training to the end of its own."""
    steps = [m for m in metrics if m["event"] == "step"][1:]
    return steps, sum(m["step_seconds"] for m in steps)


def save_plot(fig, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\nplot: {path}")
