"""`python -m areal_flow.launch [recipe=NAME] [key=value ...]`: compose, validate, prepare, run.

Everything that can be wrong with a recipe is found here, before any process starts: Hydra
rejects unknown keys and wrong types, `graph_from_config` rejects a bad graph or placement, and
the datasets are read once so a bad row is reported with its file and line.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import sys
import uuid
from pathlib import Path

import hydra
from omegaconf import DictConfig
from rich.console import Console
from rich.markup import escape

from areal_flow.checkpoint import compat, store
from areal_flow.checkpoint.compat import ResumeError
from areal_flow.config.schema import RunConfig, register_configs
from areal_flow.config.validate import (SHARED_MEMORY, ConfigError, check_known_keys, check_model,
                                        check_model_config, check_run)
from areal_flow.data.dataset import DatasetError
from areal_flow.data.loading import dataset_paths, load_prompts
from areal_flow.data.templates import check_chat_template
from areal_flow.generation.sglang_backend import shell_line, sglang_command, sglang_env, sglang_missing
from areal_flow.graph import GraphError, graph_from_config, place
from areal_flow.graph.allocation import AllocationError, allocation_problems, apply_allocation, parse_allocation
from areal_flow.graph.placement import Placement, Proc
from areal_flow.launchers.local import ChildFailed, LocalLauncher, how_it_ended, python_role
from areal_flow.launchers.progress import RunProgress, print_summary
from areal_flow.launchers.slurm import SlurmError
from areal_flow.metrics.profile import profile_table
from areal_flow.metrics.writer import read_metrics
from areal_flow.rewards.code import CodeReward
from areal_flow.rewards.sandbox import SandboxUnavailable
from areal_flow.rewards.service import resolve
from areal_flow.runtime.security import API_KEY_ENV, LOOPBACK, Security, host_address, is_loopback, security_needed
from areal_flow.runtime.spec import RunSpec, reachable, typed, write_run
from areal_flow.weights.files import last_loaded

ROOT = Path(__file__).resolve().parent.parent
# The Hydra config dir. An installed wheel holds it inside the package, as areal_flow/conf with the
# recipes as files in conf/recipe/; a source checkout or an editable install reads the repository's
# conf/, where conf/recipe is a link to recipes/, so `recipe=NAME` finds recipes/NAME.yaml.
CONF_DIR = next((d for d in (Path(__file__).resolve().parent / "conf", ROOT / "conf")
                 if (d / "config.yaml").is_file()), ROOT / "conf")

register_configs()


def prepare_data(cfg: RunConfig, prompt_key: str | None = None) -> tuple[str, str]:
    """Absolute paths of the train and held-out data, generated for tiny_arith; every row is read
    and checked, and the prompt template applied to `prompt_key` (the generate node's dataset
    input, found from the graph when not given), so a bad row or template stops the run here."""
    ds = cfg.dataset
    train, held_out = dataset_paths(ds, cfg.cache_dir)
    if prompt_key is None:
        graph = graph_from_config(cfg)
        prompt_key = graph.dataset_input(graph.generate)
    for path, split in ((train, ds.train_split), (held_out, ds.eval_split)):
        load_prompts(ds, path, split, prompt_key)
    return train, held_out


def check_tokenizer(cfg: RunConfig, model_path: str) -> None:
    """dataset.chat_template needs a tokenizer that has one: found here, not in the controller's log."""
    if cfg.dataset.chat_template:
        from areal_flow.models.tokenizer import load_tokenizer

        check_chat_template(load_tokenizer(model_path), model_path)


def prepare_model(cfg: RunConfig) -> str:
    if cfg.model.path:
        return os.path.abspath(cfg.model.path)
    from transformers.utils import logging as hf_logging

    from areal_flow.models.bootstrap import ensure_base_model

    hf_logging.disable_progress_bar()  # the bootstrap has its own progress bar
    m = cfg.model
    return ensure_base_model(os.path.join(cfg.cache_dir, "models"), arch=dict(m.arch) or None,
                             steps=m.bootstrap_steps, lr=m.bootstrap_lr, batch_size=m.bootstrap_batch_size,
                             seed=cfg.dataset.seed, heldout=(cfg.dataset.n_eval, cfg.dataset.seed), progress=True,
                             device=cfg.cluster.device_type)


def server_command(cfg: RunConfig, proc: Proc, model_path: str, port: int | str, *, host: str | None = None,
                   api_key: str | None = None, version: int = 0) -> tuple[list[str], dict[str, str]]:
    """The argv of generation server `proc` under generation.backend, and its environment beyond
    the launcher's own. `host`: the address to bind when not generation.host; `api_key`: the
    run's API key, when it is secured; `version`: the version of the weights at `model_path`
    (versions count train steps: a resumed run's servers start at its checkpoint's)."""
    gen, seed = cfg.generation, cfg.seed + proc.rank
    if gen.backend == "sglang":
        return (sglang_command(gen, model_path, port, seed, cfg.cluster.device_type, host=host, api_key=api_key,
                               version=version),
                sglang_env(proc.devices, gen.tp_size, cfg.cluster.device_type, cfg.launcher.pin_cpus))
    device = cfg.cluster.device_type
    argv = [sys.executable, "-m", "areal_flow.generation.server", "--model-path", model_path, "--host",
            host or gen.host, "--port", str(port), "--seed", str(seed), "--weight-version", str(version),
            "--device", device, "--dtype", gen.dtype or "auto"]
    if device == "cpu":  # a CPU server computes on its mesh's cores; a GPU server's threads only feed the GPU
        argv += ["--num-threads", str(max(1, len(proc.devices)))]
    if gen.deterministic or (gen.deterministic is None and cfg.rollout.max_staleness == 0):
        argv += ["--enable-deterministic-inference"]  # synchronous runs reproduce bit for bit
    if gen.mem_fraction_static is not None:
        argv += ["--mem-fraction-static", str(gen.mem_fraction_static)]
    if gen.max_batch_size is not None:
        argv += ["--max-batch-size", str(gen.max_batch_size)]
    if gen.max_total_tokens is not None:
        argv += ["--max-total-tokens", str(gen.max_total_tokens)]
    # The embedded server takes --api-key as SGLang does, and the key in its environment too: the
    # launcher uses that, since a command line is visible to every user of the host.
    return argv, ({API_KEY_ENV: api_key} if api_key is not None else {})


def server_host(cfg: RunConfig, host: str) -> str:
    """The address generation servers bind: generation.host, or this host's address `host` when
    the run is secured and generation.host would keep them on loopback."""
    return host if security_needed(cfg) and is_loopback(cfg.generation.host) else cfg.generation.host


def start_processes(launcher, placement: Placement, spec: RunSpec, cfg: RunConfig) -> None:
    # A resumed run's servers start with its checkpoint's actor, at its version.
    first = (spec.model_path, 0)
    if spec.resume:
        first = (os.path.join(spec.resume, "actor"), store.read_manifest(spec.resume)["version"])
    # Processes the local launcher restarts alone when they die (the run goes on): the workers,
    # and the servers when the weights they must load are files (the last version the controller
    # loaded: weights/files.py). A server of a trainer-sent channel has no copy to start from.
    files = cfg.rollout.weight_update_mode in ("disk", "shm")

    def command(proc: Proc, weights: tuple[str, int] = first) -> tuple[list[str], dict[str, str]]:
        if proc.role != "gen_server":
            return python_role(proc.role, proc, spec.run_dir), {}
        path, version = weights
        return server_command(cfg, proc, path, spec.gen_ports[proc.rank], api_key=spec.api_key,
                              host=server_host(cfg, spec.host_of(proc.name)), version=version)

    for proc in placement.procs:
        again = None
        if proc.role == "gen_server" and files:
            again = functools.partial(lambda proc: command(proc, last_loaded(spec.run_dir, first)), proc)
        elif proc.role in ("rollout", "reward"):
            again = functools.partial(command, proc)
        launcher.start(proc, *command(proc), again=again, restarts=cfg.recover.worker_restarts)


def describe_servers(cfg: RunConfig, placement: Placement) -> str:
    """The generation servers' command lines, for a dry run (ports and the secret are made at start)."""
    model = os.path.abspath(cfg.model.path) if cfg.model.path else f"<the bootstrapped model in {cfg.cache_dir}/models>"
    secured = security_needed(cfg)
    # On this host: its address; placed by a launcher on other nodes: each node's, known at start.
    here = cfg.launcher.type == "local" and cfg.cluster.n_nodes == 1
    api_key = "<the API key of the run>" if secured else None
    lines = [f"generation servers (generation.backend={cfg.generation.backend}):"]
    for proc in placement.of_role("gen_server"):
        host = None if not secured else server_host(cfg, host_address() if here else f"<address of node {proc.node}>")
        argv, env = server_command(cfg, proc, model, "<port>", host=host, api_key=api_key)
        lines.append(f"  {proc.name}: {shell_line(argv, env)}")
    return "\n".join(lines)


def make_launcher(cfg: RunConfig, run_dir: str, placement: Placement):
    """The launcher launcher.type names: this host's processes, or actors on a Ray cluster."""
    lc = cfg.launcher
    if lc.type == "ray":
        from areal_flow.launchers.ray_cluster import RayLauncher  # ray is an optional extra

        return RayLauncher(run_dir, placement, address=lc.ray_address, device_type=cfg.cluster.device_type,
                           start_timeout=lc.start_timeout, stop_timeout=lc.stop_timeout)
    return LocalLauncher(run_dir, device_type=cfg.cluster.device_type, pin_cpus=lc.pin_cpus,
                         stop_timeout=lc.stop_timeout)


def check_rewards(cfg: RunConfig, graph, console: Console) -> None:
    """Every reward node's function resolves, and a `code` node's sandbox can isolate programs (or
    the recipe opted out): checked at start, with the isolation in force printed."""
    problems = []
    for node in graph.rewards:
        try:
            fn = resolve(node.fn, cfg.sandbox)  # a code node's sandbox probes its isolation here
            if isinstance(fn, CodeReward):
                console.print(f"reward node {node.name}: {fn.sandbox.describe()}", highlight=False)
        except (SandboxUnavailable, ValueError) as e:
            problems.append(f"node '{node.name}' (graph.{node.name}.fn={node.fn}): {e}")
    if problems:
        raise ConfigError(problems)


def with_allocation(raw: DictConfig, console: Console) -> None:
    """An `allocation` string places the generate and batch nodes: written into `raw` itself, so
    the run directory's config.yaml, which every process reads, is the placement that runs."""
    if not raw.get("allocation"):
        return
    alloc = parse_allocation(raw.allocation)
    # Before the graph is built: a mesh past the cluster's end would be reported there, less clearly.
    if problems := allocation_problems(alloc, n_nodes=raw.cluster.n_nodes, per_node=raw.cluster.n_devices):
        raise ConfigError(problems)
    console.print(f"allocation {alloc.text.strip()!r} sets " + ", ".join(apply_allocation(raw, alloc)),
                  highlight=False, markup=False)


def run(raw: DictConfig, console: Console) -> int:
    with_allocation(raw, console)
    cfg = typed(raw)
    check_known_keys(cfg)
    graph = graph_from_config(cfg)
    check_run(cfg, graph)
    placement = place(graph, cfg.rollout.workers, cfg.generation.tp_size, cfg.cluster.n_devices)
    if cfg.dry_run:
        if cfg.model.path and os.path.isfile(os.path.join(cfg.model.path, "config.json")):
            check_model(graph, cfg.model.path, cfg.generation.tp_size)
        elif cfg.model.path:  # a cluster's model need not be on the machine that plans the run
            console.print(f"model.path={cfg.model.path} is not here: the layouts were not checked against it",
                          highlight=False, markup=False)
        console.print(graph.describe(), highlight=False, markup=False)
        console.print(placement.describe(cfg.cluster.device_type), highlight=False, markup=False)
        console.print(describe_servers(cfg, placement), highlight=False, markup=False)
        if cfg.launcher.type == "slurm":
            from areal_flow.launchers.slurm import sbatch_script

            run_dir = os.path.abspath(cfg.output_dir)
            console.print(f"sbatch script (RUN_DIR/job.sbatch, not submitted: dry_run=true):\n"
                          f"{sbatch_script(cfg, placement, run_dir)}", highlight=False, markup=False)
        return 0
    if cfg.generation.backend == "sglang" and (problem := sglang_missing()):
        raise ConfigError([problem])
    check_rewards(cfg, graph, console)
    run_dir = os.path.abspath(cfg.output_dir)
    train_path, eval_path = prepare_data(cfg, graph.dataset_input(graph.generate))
    model_path = prepare_model(cfg)
    check_model_config(cfg.model.path)
    check_model(graph, model_path, cfg.generation.tp_size)
    check_tokenizer(cfg, model_path)
    if cfg.launcher.type == "slurm":
        return submit_slurm(raw, cfg, placement, console, run_dir=run_dir, model_path=model_path,
                            train_path=train_path, eval_path=eval_path)
    resume = None
    if cfg.resume:
        resume, run_dir = compat.find(cfg.resume, run_dir)
        if resume is None:
            console.print(f"resume=auto: {store.folder(run_dir)} holds no complete checkpoint: starting the run",
                          highlight=False, markup=False)
        else:
            compat.check(resume, raw)
            raw.output_dir = run_dir  # the run goes on in its own directory
    for attempt in range(cfg.recover.retries + 1):
        if resume is not None:
            console.print(f"resuming from {resume} (step {store.read_manifest(resume)['step']})", highlight=False)
            store.rewind(run_dir, resume)
        code, spec = launch_once(raw, cfg, placement, console, run_dir=run_dir, model_path=model_path,
                                 train_path=train_path, eval_path=eval_path, resume=resume)
        if code != 1 or attempt == cfg.recover.retries:
            break
        console.print(f"recover: restart {attempt + 1} of {cfg.recover.retries} (recover.retries)", highlight=False)
        if (resume := store.latest(run_dir)) is None:
            console.print("recover: no checkpoint yet: the run starts again", highlight=False)
            store.rewind(run_dir, None)
    if code:
        return code
    metrics = read_metrics(spec.path("metrics.jsonl"))
    print_summary(console, run_dir, metrics)
    with open(spec.path("profile.md"), "w") as f:
        f.write(profile_table(metrics))
    console.print(f"step profile: {spec.path('profile.md')}", highlight=False)
    if cfg.metrics.plot:
        from areal_flow.metrics.plot import plot_learning_curve  # matplotlib: half a second of every start
        from areal_flow.metrics.profile import plot_timeline

        png = plot_learning_curve(metrics, spec.path("learning_curve.png"), f"{cfg.recipe} (η={cfg.rollout.max_staleness})")
        console.print(f"learning curve: {png}", highlight=False)
        if any(m["event"] == "step" for m in metrics):
            png = plot_timeline(metrics, spec.path("profile.png"), title=f"{cfg.recipe}: the last steps")
            console.print(f"step timeline: {png}", highlight=False)
    return 0


def launch_once(raw: DictConfig, cfg: RunConfig, placement: Placement, console: Console, *, run_dir: str,
                model_path: str, train_path: str, eval_path: str, resume: str | None) -> tuple[int, RunSpec]:
    """Start every process of the run (from the checkpoint `resume`, when given) and watch them
    until the controller finishes: (0, spec) when it did; 1 when a process died; 130 when stopped
    (SIGINT or SIGTERM), after the controller saved a checkpoint at the end of its step when
    checkpoint.at_stop."""
    # Made by trainer rank 0 at its first publish; removed when the run ends (shared memory is RAM).
    weights_dir = os.path.join(SHARED_MEMORY, f"areal_flow-{uuid.uuid4().hex[:12]}") \
        if cfg.rollout.weight_update_mode == "shm" else ""
    # A secured run listens on this host's address, with a secret made here (docs/security.md).
    security = Security.new() if security_needed(cfg) else None
    host = host_address() if security is not None else LOOPBACK
    launcher = make_launcher(cfg, run_dir, placement)
    launcher.on_restart = lambda name, code: console.print(
        f"process '{name}' {how_it_ended(code)}: restarted, the run goes on (its log: {launcher.log_path(name)})",
        highlight=False, markup=False)
    # A free port on the node of each process that listens (trainer 0's node twice: its inbox and the
    # trainers' torch.distributed rendezvous), in the order the spec lists them. Secured: free on
    # every address, since servers bind the host's address, loopback (torch.distributed) and maybe a
    # wildcard (generation.host).
    listeners = [p.name for r in ("gen_server", "rollout", "trainer") for p in placement.of_role(r)]
    names = [*listeners, "controller", "trainer0"]
    reserved = launcher.reserve(names, wildcard=security is not None)
    ports = dict(zip([*listeners, "controller", "dist"], (port for _, port in reserved)))
    # Processes a launcher put on other nodes (Ray) listen on, and are reached at, their node's address.
    hosts = {name: addr for name, (addr, _) in zip(names, reserved) if not is_loopback(addr)}
    spec = spec_with_ports(placement, ports, run_dir=run_dir, model_path=model_path, train_path=train_path,
                           eval_path=eval_path, gen_host=reachable(server_host(cfg, host)), weights_dir=weights_dir,
                           host=host, hosts=hosts, security=security, resume=resume or "")
    write_run(run_dir, raw, spec)
    console.print(f"run directory: {run_dir}", highlight=False)
    if security is not None:
        console.print(f"secured: servers listen on {host}; ZeroMQ is CURVE-encrypted and the generation "
                      "servers take the run's API key (in spec.json, owner-only)", highlight=False)
    previous = signal.signal(signal.SIGTERM, _interrupt)  # a scheduler's SIGTERM stops the run as Ctrl-C does
    try:
        start_processes(launcher, placement, spec, cfg)
        with RunProgress(spec.path("metrics.jsonl"), cfg.total_steps, console) as progress:
            launcher.wait("controller", on_tick=progress.tick)
    except ChildFailed as e:
        console.print(f"[bold red]run failed:[/] {escape(str(e))}", highlight=False)
        return 1, spec
    except KeyboardInterrupt:
        stop_with_checkpoint(launcher, cfg, console)
        return 130, spec
    finally:
        signal.signal(signal.SIGTERM, previous)
        launcher.stop_all()
        if weights_dir:
            shutil.rmtree(weights_dir, ignore_errors=True)
    return 0, spec


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def stop_with_checkpoint(launcher, cfg: RunConfig, console: Console) -> None:
    """The launcher was stopped: with checkpoint.at_stop, the controller saves a checkpoint at the
    end of its current step and exits (SIGUSR1), within checkpoint.stop_timeout; a second Ctrl-C
    stops at once. Every process is stopped after."""
    if not cfg.checkpoint.at_stop or not hasattr(launcher, "signal"):
        console.print("[bold red]interrupted[/]: stopping every process")
        return
    console.print("[bold red]interrupted[/]: the run saves a checkpoint after the current step, then stops "
                  f"(up to {cfg.checkpoint.stop_timeout:.0f} s; Ctrl-C again stops at once)")
    try:
        launcher.signal("controller", signal.SIGUSR1)
        launcher.wait("controller", timeout=cfg.checkpoint.stop_timeout)
        console.print(f"stopped; continue with resume=auto hydra.run.dir={launcher.run_dir}", highlight=False,
                      markup=False)
    except (KeyboardInterrupt, ChildFailed, TimeoutError, NotImplementedError) as e:
        console.print(f"stopped without a checkpoint: {escape(str(e)) or 'interrupted again'}", highlight=False)


def spec_with_ports(placement: Placement, ports: dict[str, int], **fields) -> RunSpec:
    """The run spec with the port of each listening process (`ports`: process name -> port, and
    'dist' for the trainers' torch.distributed rendezvous) and `fields`."""
    names = {r: [p.name for p in placement.of_role(r)] for r in ("gen_server", "rollout", "trainer")}
    return RunSpec(gen_ports=[ports[n] for n in names["gen_server"]], rollout_ports=[ports[n] for n in names["rollout"]],
                   trainer_ports=[ports[n] for n in names["trainer"]], controller_port=ports["controller"],
                   dist_port=ports["dist"], n_trainers=len(names["trainer"]), n_rollout=len(names["rollout"]), **fields)


def submit_slurm(raw: DictConfig, cfg: RunConfig, placement: Placement, console: Console, *, run_dir: str,
                 model_path: str, train_path: str, eval_path: str) -> int:
    """launcher.type=slurm: write the run directory (config, spec with the run's secret and ports;
    the job adds the hosts) and the job script, submit it, and leave: the job runs on its own."""
    from areal_flow.launchers.slurm import fixed_ports, sbatch_script, submit

    if any(c.isspace() for c in run_dir):
        # #SBATCH lines are not read by a shell: a path with spaces cannot be quoted there.
        raise ConfigError([f"output_dir={run_dir!r}: launcher.type=slurm needs a run directory without spaces"])
    spec = spec_with_ports(placement, fixed_ports(placement, cfg.launcher.slurm_base_port), run_dir=run_dir,
                           model_path=model_path, train_path=train_path, eval_path=eval_path,
                           security=Security.new())  # a Slurm run spans hosts: always secured (security_needed)
    write_run(run_dir, raw, spec)
    os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)
    script = os.path.join(run_dir, "job.sbatch")
    with open(script, "w") as f:
        f.write(sbatch_script(cfg, placement, run_dir))
    job_id = submit(script)
    console.print(f"run directory: {run_dir}\nsubmitted Slurm job {job_id} ({script})\n"
                  f"  follow it:  squeue -j {job_id}; tail -f {run_dir}/logs/job-{job_id}.log {run_dir}/logs/controller.log\n"
                  f"  stop it:    scancel {job_id}", highlight=False, markup=False)
    return 0


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> None:
    console = Console(soft_wrap=True)
    try:
        code = run(cfg, console)
    except (GraphError, ConfigError, DatasetError, AllocationError, SlurmError, ResumeError) as e:
        # escape: a message may hold brackets, e.g. pip install -e '.[sglang]'
        console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False)
        code = 2
    if code:
        sys.exit(code)


def check_yaml(argv: list[str]) -> str | None:
    """Hydra reports a malformed YAML file with a 90-line traceback; find it first and say which
    file and line in one message. Checks conf/, recipes/ and every hydra.searchpath folder."""
    import re

    import yaml

    folders = [CONF_DIR]
    if (CONF_DIR / "recipe").is_symlink():  # rglob does not follow the conf/recipe link: add its target
        folders.append((CONF_DIR / "recipe").resolve())
    for arg in argv:
        if arg.startswith("hydra.searchpath="):
            folders += [Path(p) for p in re.findall(r"file://([^,\]\s]+)", arg)]
    for folder in folders:
        for path in sorted(folder.rglob("*.yaml")):
            try:
                yaml.safe_load(path.read_text())
            except yaml.YAMLError as e:
                mark = getattr(e, "problem_mark", None)
                where = f"{path}, line {mark.line + 1}" if mark else str(path)
                return f"malformed YAML in {where}: {getattr(e, 'problem', None) or e}"
    return None


if __name__ == "__main__":
    if problem := check_yaml(sys.argv[1:]):
        Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {problem}", highlight=False)
        sys.exit(2)
    main()
