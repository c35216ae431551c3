"""A run from its composed config to its end: the steps `python -m areal_flow.launch` takes.

`launch.py` reads compose → validate → plan → start; each step is a module here:

- `recipe_files.py` — before and while Hydra composes: `recipe=PATH`, recipe names and override keys
  checked, and each YAML file Hydra reads (only those) checked as it is read.
- `compose.py` — the typed config, with an `allocation` string applied.
- `checks.py` — every rule of a run before anything starts (`validate`), and the checks that need
  the prepared model and reward functions.
- `env_checks.py` — a multi-turn environment's and an agent's imports (before the data and the
  model are made), and the environment made from a real training row (once they are).
- `prepare.py` — the data and the base model, read or made once, before any process starts.
- `dry_run.py` — `dry_run=true`: the graph, the placement and the servers' command lines.
- `submit.py` — `launcher.type=slurm`: the run directory and the job script, submitted.
- `ports.py` — a local or Ray run's spec: a port per listening process, the hosts, the secret.
- `start.py` — start the processes, watch them, restart the run from its checkpoint.
- `stop.py` — Ctrl-C or SIGTERM: stop, after a checkpoint at the end of the current step.
- `summary.py` — the summary, step profile and plots of a finished run.

This package is the top of areal_flow's layers: it may import any other package, and none
imports it but `launch.py` (tests/test_package_layers.py).
"""
