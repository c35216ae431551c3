"""Helpers of the end-to-end tests: launch a small run of the real system and read what it wrote."""

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import yaml

RECIPE_ETA = yaml.safe_load((Path(__file__).resolve().parents[1] / "recipes" / "tiny_arith.yaml").read_text()
                            )["rollout"]["max_staleness"]
"""The default recipe's η, which runs that do not set one (and recipes built on tiny_arith) keep."""

SMALL = [
    "total_steps=4", "algorithm.batch_size=2", "algorithm.group_size=4", "rollout.max_concurrent=8",
    "dataset.n_train=400", "dataset.n_eval=16", "model.bootstrap_steps=30", "model.bootstrap_batch_size=32",
    "max_wall_seconds=0", "launcher.start_timeout=90", "metrics.plot=false",  # plots: one test asks for them
    # The recipe trains only groups whose answers differ; the small models answer all of them
    # alike (all wrong), so the tests of the system's parts train every group unless they ask for
    # the filter. The tests of a shipped recipe (launch_recipe) do not: they name it when they need it.
    TRAIN_EVERY_GROUP := "algorithm.success_rate_range=null",
]
SHIPPED = [o for o in SMALL if o != TRAIN_EVERY_GROUP]
"""SMALL's sizes, with a recipe's own dynamic filtering."""


def small_with(*overrides: str) -> list[str]:
    """SMALL without the keys `overrides` set (a launch may give each key once), then `overrides`."""
    keys = {o.split("=", 1)[0] for o in overrides}
    return [*(o for o in SMALL if o.split("=", 1)[0] not in keys), *overrides]


# The SMALL bootstrap answers nothing right, so every group's advantages would be 0: a model that
# answers some problems (150 bootstrap steps, cached once per session) and groups of 8 make the
# steps carry gradients.
ANSWERS_SOME = ("model.bootstrap_steps=150", "algorithm.group_size=8", "algorithm.batch_size=3")


# A run at η = 0 from the model that answers some problems, with a checkpoint every 2 steps: the
# uninterrupted run of tests/test_reproducible.py, whose steps tests/test_end_to_end.py also checks
# for synchronous training (the session's `eta0_run`, tests/conftest.py: one run for both).
ETA0_RUN = ("rollout.max_staleness=0", "total_steps=5", "eval_at_start=false", "eval_at_end=false", *ANSWERS_SOME,
            "checkpoint.every_steps=2", "recover.retries=1")


def build_base_models(cache: Path, variants: list[tuple[str, ...]]) -> None:
    """Bootstrap into `cache` the base model of a launch with each variant's overrides, as the
    launcher's own preparation would (run/prepare.py), so that the runs find it built; in order.
    Run by tests/conftest.py in a process of its own while the session's other tests run."""
    from hydra import compose, initialize_config_dir

    from areal_flow.launch import CONF_DIR
    from areal_flow.run.prepare import prepare_model
    from areal_flow.runtime.spec import typed

    for overrides in variants:
        with initialize_config_dir(str(CONF_DIR), version_base=None):
            raw = compose("config", overrides=[*SMALL, f"cache_dir={cache}", f"output_dir={cache}/unused", *overrides])
        print(prepare_model(typed(raw)), flush=True)


def launch(run_dir: Path, cache: Path, *overrides: str) -> subprocess.CompletedProcess:
    """A small run (SMALL) of the default recipe, every group trained, with the test's `overrides`."""
    return _launch(SMALL, run_dir, cache, overrides)


def launch_recipe(run_dir: Path, cache: Path, recipe: str, *overrides: str,
                  env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """A small run of recipes/RECIPE.yaml as shipped: SMALL's sizes and the test's `overrides`, and
    nothing else changed (TRAIN_EVERY_GROUP only where the test names it); `env`: added to the
    launcher's environment (a PYTHONPATH for a test's own module)."""
    return _launch(SHIPPED, run_dir, cache, (f"recipe={recipe}", *overrides), env)


def _launch(base: list[str], run_dir: Path, cache: Path, overrides: tuple[str, ...],
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "areal_flow.launch", *base, f"cache_dir={cache}", f"hydra.run.dir={run_dir}", *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=run_dir.parent,
                          env=None if env is None else {**os.environ, **env})


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 240) -> None:
    """Until a run started with Popen (`proc`, its output piped) has trained `step` steps."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        if (run_dir / "metrics.jsonl").exists() and any(m["step"] >= step for m in steps_of(run_dir)):
            return
        time.sleep(0.2)
    raise TimeoutError(f"step {step} not reached")


def kill_trainer_after_checkpoint(run_dir: Path, proc: subprocess.Popen, step: int) -> str:
    """kill -9 the trainer of a run started with Popen (`proc`, its output piped) as soon as its
    checkpoint of `step` is complete, then wait for the run to end (it restarts itself from the
    checkpoint: recover.retries); returns its output. A kill any later could land after the next
    step's row (steps take a fraction of a second)."""
    import signal

    try:
        checkpoint = run_dir / "checkpoints" / f"step-{step:08d}"
        deadline = time.monotonic() + 240
        while not (checkpoint / "manifest.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline, f"no checkpoint of step {step}"
            time.sleep(0.02)
        os.kill(run_processes(run_dir)["trainer0"], signal.SIGKILL)
        out, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    return out


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def steps_of(run_dir: Path) -> list[dict]:
    return [m for m in jsonl(run_dir / "metrics.jsonl") if m["event"] == "step"]


def run_processes(run_dir: Path) -> dict[str, int]:
    """Live processes the launcher started for this run (it marks them with AREAL_FLOW_RUN): name -> pid."""
    marker = f"AREAL_FLOW_RUN={run_dir}".encode()
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
            if marker in env and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z":
                name = next(e for e in env if e.startswith(b"AREAL_FLOW_PROC=")).split(b"=", 1)[1].decode()
                found[name] = int(pid)
        except (OSError, StopIteration):
            continue
    return found


def leftover_processes(run_dir: Path) -> list[int]:
    return list(run_processes(run_dir).values())


def check_accounting(run_dir: Path, eta: int, group_size: int = 4, drops: bool = False) -> dict:
    """Every admitted group is trained exactly once or still accounted for; staleness ≤ η. `drops`:
    groups may be dropped (each once, never also trained), as a run that expects them says."""
    ledger = jsonl(run_dir / "ledger.jsonl")
    admitted = {e["group"]: e["version"] for e in ledger if e["event"] == "admit"}
    trained_steps = {g: e["step"] for e in ledger if e["event"] == "train" for g in e["groups"]}
    finished = {e["group"] for e in ledger if e["event"] == "finish"}
    dropped = {e["group"] for e in ledger if e["event"] == "drop"}
    filtered = {e["group"] for e in ledger if e["event"] == "filter"}
    assert not filtered & (finished | dropped)
    # Each scored group's answer lengths and stage times, in the order the pipeline passes them.
    admit_time = {}  # its first admission: a group admitted again (a restart) may finish from its first copy
    for e in ledger:
        if e["event"] == "admit":
            admit_time.setdefault(e["group"], e["time"])
    for e in (e for e in ledger if e["event"] in ("finish", "filter")):
        assert len(e["lengths"]) == group_size and all(n >= 1 for n in e["lengths"]), e
        assert admit_time[e["group"]] <= e["requested"] <= e["generated"] <= e["scored"] <= e["time"], e
    trained_logs = [f for f in sorted(run_dir.glob("trained-rank*.jsonl")) if "discarded" not in f.name]  # a resume's cut
    uids = [u for f in trained_logs for r in jsonl(f) for u in r["uids"]]
    assert len(uids) == len(set(uids)), "a sample was trained twice"
    groups_from_trainer = Counter(int(u.split("-")[0][1:]) for u in uids)
    assert set(groups_from_trainer) == set(trained_steps)
    assert all(n == group_size for n in groups_from_trainer.values())  # whole groups
    assert set(trained_steps) <= finished <= set(admitted)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["admitted_groups"] == len(admitted) and summary["trained_groups"] == len(trained_steps)
    assert summary["buffered_groups_at_end"] == len(finished - set(trained_steps))
    assert summary["dropped_groups"] == len(dropped) and (drops or not dropped)
    assert not dropped & (finished | set(trained_steps))
    assert summary.get("filtered_groups", 0) == len(filtered)
    running = set(admitted) - finished - dropped - filtered
    assert summary["running_groups_at_end"] == len(running)
    tokens = {e["group"]: e.get("tokens", {}) for e in ledger if e["event"] == "finish"}
    for g, step in trained_steps.items():
        assert step - admitted[g] <= eta, f"group {g} admitted at v{admitted[g]} trained at step {step}"
        # Each answer token's own version too (the ledger's finish event counts them by version).
        assert all(step - int(v) <= eta for v in tokens[g]), f"group {g} trained at step {step}: {tokens[g]}"
    # Each step's weights are loaded once, in order, before the run ends; the trainer may train the
    # next step meanwhile, never the one after it.
    order = [(e["event"], e["step"] if e["event"] == "train" else e["version"]) for e in ledger
             if e["event"] in ("train", "loaded")]
    loaded = [v for event, v in order if event == "loaded"]
    assert loaded == list(range(1, summary["steps"] + 1)), loaded
    position = {o: i for i, o in enumerate(order)}
    for v in loaded:
        if ("train", v + 1) in position:
            assert position[("loaded", v)] < position[("train", v + 1)], f"step {v + 1} began before v{v} was loaded"
    return summary


def processes_of_uids(uids: set[int]) -> list[int]:
    """The pids of processes running as one of `uids` (a sandbox's programs left behind)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}").st_uid in uids:
                pids.append(int(pid))
        except FileNotFoundError:
            pass
    return pids


def replay(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    """`python -m areal_flow.replay RUN_DIR ARGS`, its table wide enough to read."""
    return subprocess.run([sys.executable, "-m", "areal_flow.replay", str(run_dir), *args], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "COLUMNS": "200"})


def change_a_trained_logprob(run_dir: Path, steps: range, rank: int, by: float) -> int:
    """Move one behaviour logprob by `by` in rank `rank`'s flight record: of the first sample, in the
    first of `steps` (from 0) that has one, whose group's answers scored differently (it has a
    gradient, so the change must show in the weights). Returns the step."""
    import msgspec

    from areal_flow.training import flight
    from areal_flow.transport.messages import Array

    for step in steps:
        record = flight.read(str(run_dir), step, rank)
        rewards: dict[int, set] = {}
        for s in record.samples:
            rewards.setdefault(s.group_id, set()).add(s.scalars["rewards"])
        varied = [s for s in record.samples if len(rewards[s.group_id]) > 1 and len(s.array("behav_logprobs"))]
        if varied:
            behav = varied[0].array("behav_logprobs").copy()
            behav[0] += by
            varied[0].arrays["behav_logprobs"] = Array.of(behav)
            with open(flight.path_of(str(run_dir), step, rank), "wb") as f:
                f.write(msgspec.msgpack.encode(record))
            return step
    raise AssertionError(f"rank {rank} trained no group whose answers scored differently in steps {steps}")
