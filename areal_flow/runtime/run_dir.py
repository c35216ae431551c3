"""Every file and folder under a run directory (hydra.run.dir), named once.

A run directory is the run's whole record and its processes' meeting point: the launcher, the
controller, the trainer ranks, the servers, `python -m areal_flow.scale` and `python -m
areal_flow.status` find each other's files here. Each name below is relative to the run directory
(or, under "A checkpoint's files", to one checkpoint's folder), and the module that writes it says
so; readers import the name from here, so a file is never spelt twice. docs/architecture.md has the
tree.
"""

from __future__ import annotations

import os
import re

# What the run is.
CONFIG = "config.yaml"
"""The run's resolved config, written at launch (runtime/spec.py) and copied into each checkpoint."""
HYDRA_CONFIG = os.path.join(".hydra", "config.yaml")
"""Hydra's own copy of the composed config, before the launcher resolves it."""
HYDRA_LOG = "launch.log"
"""Hydra's log of the launcher (Hydra names it after the entry point, launch.py)."""
SPEC = "spec.json"
"""The run's processes, hosts and ports (runtime/spec.py: RunSpec); owner-only, it holds the run's key."""
LOCK = "launcher.lock"
"""Held (flock) by the run's launcher for its whole life (run/lock.py)."""
PROCESSES = "processes.json"
"""The launcher's table of the run's processes and their pids (status/processes.py)."""
LOGS = "logs"
"""One log a process: logs/<process>.log (log_of)."""
RAY_PLACEMENT = "ray_placement.json"
"""Where the Ray launcher placed each process (launchers/ray_cluster.py)."""
SLURM_HOSTS = "slurm_hosts.json"
"""The Slurm job's hosts and their addresses (launchers/slurm_job.py)."""
SBATCH = "job.sbatch"
"""The batch script `launcher.type=slurm` submitted (run/submit.py)."""
SLURM_JOB = "slurm_job"
"""The id of the Slurm job `launcher.type=slurm` last submitted for the directory: a later launch
into it asks Slurm whether that job still runs (run/lock.py)."""

# What the run recorded.
METRICS = "metrics.jsonl"
"""One row a train step and an evaluation (metrics/writer.py); the progress display tails it."""
LEDGER = "ledger.jsonl"
"""Every prompt group's events, from admission to training (controller/ledger)."""
TRAINED = "trained-rank{rank}.jsonl"
"""The groups trainer rank `rank` trained, one line a step (training/worker.py)."""
TENSORBOARD = "tensorboard"
"""TensorBoard's event files, when metrics.backends lists it."""
EVALS = "evals"
"""Held-out answers, one file an evaluation: evals/version-<v>.jsonl (controller/evaluation.py)."""
DUMPS = "dumps"
"""Sample dumps (dump.every_steps) and dumped weights (training/dumps.py)."""
FLIGHT = "flight"
"""The flight record: each trainer rank's step, exactly, for replay (training/flight.py)."""
FLIGHT_STEP = os.path.join(FLIGHT, "step-{step:08d}-rank{rank}.msgpack")
"""One step of one trainer rank's flight record (the step counted from 1, as the metrics rows)."""
FLIGHT_STEP_NAME = re.compile(r"step-(\d{8})-rank(\d+)\.msgpack$")
"""FLIGHT_STEP's file name, read back: groups (step from 1, rank)."""
FLIGHT_DISCARDED = os.path.join(FLIGHT, "discarded")
"""Where a resume moves the records of the steps it redoes (checkpoint/store.py `rewind`)."""
SUMMARY = "summary.json"
"""The run's end: its figures and why it stopped (controller/ending.py)."""
PROFILE = "profile.md"
"""The summary table of where a step's time went, written at the end (run/summary.py)."""
PROFILE_PLOT = "profile.png"
"""The timeline of the last steps (run/summary.py)."""
LEARNING_CURVE = "learning_curve.png"
"""The held-out curve (run/summary.py)."""
EXPORT = "checkpoint"
"""The Hugging Face checkpoint exported at the end of a run that was not stopped."""

# Weights on their way to the servers.
WEIGHTS = "weights"
"""Published weights, one folder a version, unless rollout.weights_dir puts them elsewhere."""
WEIGHTS_LOADED = "weights_loaded.json"
"""The last version every server loaded as files: {path, version} (weights/files.py)."""

# The scale and resize handshakes (launchers/elastic.py, generation/client/membership.py, runtime/resize.py).
SERVERS = "servers.json"
"""The generation servers now serving, rewritten at each scale (generation/client/membership.py)."""
SCALE = "scale"
"""The folder of the scale handshake's files below."""
SCALE_REQUEST = os.path.join(SCALE, "request.json")
"""A scale asked for by `python -m areal_flow.scale` or the autoscaler, read by the launcher."""
SCALE_RESULTS = os.path.join(SCALE, "results.jsonl")
"""The launcher's answer to each scale request, one line each."""
SCALE_DECISIONS = os.path.join(SCALE, "decisions.jsonl")
"""The autoscaler's decisions and the figures behind them (launchers/autoscale.py)."""
SCALE_ACKS = os.path.join(SCALE, "acks")
"""One file a process that has read a new servers.json (membership acknowledgements)."""
SCALE_READY = os.path.join(SCALE, "ready")
"""One file a joining server that has loaded the current weights."""
TRAINERS_ASK = os.path.join(SCALE, "trainers.json")
"""A trainer resize asked of the controller (runtime/resize.py)."""
TRAINERS_SAVED = os.path.join(SCALE, "trainers-saved.json")
"""The controller's checkpoint for a trainer resize is complete."""
TRAINERS_DONE = os.path.join(SCALE, "trainers-done.json")
"""The resized trainers resumed from it."""

# The run's resumable checkpoints.
CHECKPOINTS = "checkpoints"
"""One folder a resumable checkpoint: checkpoints/step-<n> (checkpoint/store.py)."""

# A checkpoint's files (relative to one checkpoint's folder).
MANIFEST = "manifest.json"
"""Written last: a checkpoint without it was never completed."""
RUN_STATE = "run_state.json"
"""The controller's state: step, version, data position, the groups in flight (controller/state.py)."""
TRAIN_STATE = "train_state.pt"
"""Beside a checkpoint's Hugging Face files, what an exact resume of the model needs (a single rank)."""
SHARDED_STATE = "dcp"
"""Model and optimizer state written by torch.distributed.checkpoint, each rank its own shards."""
RESUMABLE_META = "meta.pt"
"""Rank 0's small state: engine, layout, world size, LR schedule, version, extra state."""
RANK_RNG = "rng-rank{rank}.pt"
"""One rank's RNG states."""
HELD = "held-rank{rank}.msgpack"
"""The samples a trainer rank held but had not trained (training/rank_checkpoint.py)."""
TRAINER_STATE = "trainer-rank{rank}.json"
"""A trainer rank's trained-samples log length, to which a resume cuts TRAINED."""


def log_of(process: str) -> str:
    """A process's log, relative to the run directory."""
    return os.path.join(LOGS, f"{process}.log")


def of_rank(name: str, rank: int) -> str:
    """A per-rank name (TRAINED, RANK_RNG, HELD, TRAINER_STATE) for `rank`."""
    return name.format(rank=rank)
