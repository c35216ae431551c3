"""`python -m areal_flow.launch [recipe=NAME|PATH] [key=value ...]`: compose, validate, plan, start.

Everything that can be wrong with a recipe is found here, before any process starts: Hydra
rejects unknown keys and wrong types, `run/checks.py` a bad graph, placement or combination of
keys, and the datasets are read once so a bad row is reported with its file and line. Each step
is a module of `areal_flow/run/`; this module only puts them in order, and is Hydra's entry.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.markup import escape

from areal_flow.checkpoint.compat import ResumeError
from areal_flow.config.schema import register_configs
from areal_flow.config.validate import ConfigError
from areal_flow.data.dataset import DatasetError
from areal_flow.graph import GraphError, place
from areal_flow.graph.allocation import AllocationError
from areal_flow.launchers.slurm import SlurmError
from areal_flow.run.checks import staleness_warning, validate
from areal_flow.run.compose import compose
from areal_flow.run.dry_run import dry_run
from areal_flow.run.lock import RunDirBusy, hold_run_dir
from areal_flow.run.prepare import prepare
from areal_flow.run.recipe_files import RecipeError, recipe_args, watch_hydra_files
from areal_flow.run.start import start_watched
from areal_flow.run.submit import submit_slurm
from areal_flow.run.summary import report

ROOT = Path(__file__).resolve().parent.parent
# The Hydra config dir. An installed wheel holds it inside the package, as areal_flow/conf with the
# recipes as files in conf/recipe/; a source checkout or an editable install reads the repository's
# conf/, where conf/recipe is a link to recipes/, so `recipe=NAME` finds recipes/NAME.yaml.
CONF_DIR = next((d for d in (Path(__file__).resolve().parent / "conf", ROOT / "conf")
                 if (d / "config.yaml").is_file()), ROOT / "conf")

register_configs()

NAME_BYTES = 200
"""A multirun job's folder name is its overrides (hydra.sweep.subdir); past this many bytes it is
cut and ends in a hash of the whole, so that a long sweep fits the file system's 255 bytes a name."""


def short_name(name: str) -> str:
    """`name` as it is when short enough, else its first bytes and a hash of all of it: the same
    overrides give the same folder, so a multirun with resume=auto finds each job again."""
    import hashlib

    raw = name.encode()
    if len(raw) <= NAME_BYTES:
        return name
    head = raw[:NAME_BYTES - 17].decode(errors="ignore").rstrip(",")
    return f"{head},{hashlib.sha1(raw).hexdigest()[:16]}"


OmegaConf.register_new_resolver("short_name", short_name, replace=True)


def run(raw: DictConfig, console: Console) -> int:
    """Compose → validate → plan → start; the exit code of the run."""
    cfg = compose(raw, console)
    graph = validate(cfg)
    if warning := staleness_warning(cfg):
        console.print(f"[yellow]warning:[/] {escape(warning)}", highlight=False)
    placement = place(graph, cfg.rollout.workers, cfg.generation.tp_size, cfg.cluster.n_devices)
    if cfg.dry_run:
        return dry_run(cfg, graph, placement, console)
    # Before the data and the model are prepared: a second launch into a live run's directory writes nothing.
    what = f"hydra.run.dir={cfg.output_dir}"
    hold_run_dir(cfg.output_dir, f"resume={cfg.resume}: {what}" if cfg.resume == "auto" else what)
    prepared = prepare(cfg, graph, console)
    if cfg.launcher.type == "slurm":
        return submit_slurm(raw, cfg, placement, prepared, console)
    code, spec = start_watched(raw, cfg, placement, prepared, console)
    if code == 0:
        report(cfg, spec, console)
    return code


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> None:
    console = Console(soft_wrap=True)
    try:
        code = run(cfg, console)
    except (GraphError, ConfigError, DatasetError, AllocationError, SlurmError, ResumeError, RunDirBusy) as e:
        # escape: a message may hold brackets, e.g. pip install -e '.[sglang]'
        console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False)
        code = 2
    except KeyboardInterrupt:
        # Ctrl-C before any process started (a started run stops itself: run/start.py). The base
        # model's bootstrap trains in a temp directory renamed into the cache only when complete,
        # and generated data is published the same way, so nothing half-made is left to reuse.
        console.print("[bold red]interrupted[/] before the run started: nothing half-made was cached", highlight=False)
        code = 130
    if code:
        sys.exit(code)


def check_run_dir(argv: list[str]) -> str | None:
    """Hydra makes hydra.run.dir (or hydra.sweep.dir) before the task runs, and a directory that
    cannot be made ends in its traceback: make it here first and say which key and why in one line."""
    import os

    for arg in argv:
        key, _, value = arg.partition("=")
        if key.lstrip("+") in ("hydra.run.dir", "hydra.sweep.dir") and value and "${" not in value:
            try:
                os.makedirs(value, exist_ok=True)
            except OSError as e:
                return f"{key.lstrip('+')}={value!r}: cannot make the directory ({e.strerror or e})"
    return None


if __name__ == "__main__":
    # A shell starts a background job (`cmd &` in a script, CI, nohup) with SIGINT ignored, and Python
    # then installs no KeyboardInterrupt handler: a later `kill -INT` or Ctrl-C would be lost and the
    # run would never stop gracefully. The launcher always listens for it.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def refuse(problem: str) -> None:
        Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {escape(problem)}", highlight=False)

    try:
        sys.argv[1:] = recipe_args(sys.argv[1:], CONF_DIR)  # recipe=PATH: an option Hydra finds
    except RecipeError as e:
        refuse(str(e))
        sys.exit(2)
    if problem := check_run_dir(sys.argv[1:]):
        refuse(problem)
        sys.exit(2)
    # Hydra reports a malformed YAML file with a 90-line traceback: each file it reads is checked as
    # it is read, and only those (never a folder's other YAML files).
    watch_hydra_files(refuse)
    main()
