"""The checks of a run, before anything starts: the rules that span several fields, the graph,
the machine and the packages installed (`check_run`); the model's and tokenizer's fit to the
graph, and the reward functions (once they are prepared). `config/validate.py` holds the checks
that need nothing but the schema (ranges, unknown keys). Every problem names the key to change;
all of them are reported at once.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re

from rich.console import Console

from areal_flow.config.schema import RunConfig
from areal_flow.config.validate import ConfigError, check_known_keys, check_ranges, load_model_config
from areal_flow.data.dataset import DatasetError
from areal_flow.data.templates import check_chat_template, template_fields
from areal_flow.generation.limits import MAX_N
from areal_flow.generation.sglang_backend import generation_problems
from areal_flow.graph.dag import Graph, graph_from_config
from areal_flow.graph.mesh import format_mesh
from areal_flow.graph.layout import layout_problems
from areal_flow.launchers.slurm import sbatch_missing
from areal_flow.models.tokenizer import missing_tokenizer_files
from areal_flow.rewards.code import CodeReward
from areal_flow.sandbox.local import SandboxUnavailable
from areal_flow.rewards.service import AGENT_FN, builtin_names, resolve

SHARED_MEMORY = "/dev/shm"
"""Where rollout.weight_update_mode=shm puts the published weights."""


def _machine(cfg: RunConfig) -> list[str]:
    problems = []
    kind, n = cfg.cluster.device_type, cfg.cluster.n_devices
    local = cfg.launcher.type not in ("ray", "slurm")  # processes on this host (ray and slurm: on their nodes)
    if kind == "cuda" and local and not cfg.dry_run:
        from areal_flow.runtime.devices import cuda_problems, visible_gpus  # imports torch

        # Found here, before any process starts, rather than as a crash in each process's log.
        problems += cuda_problems(n, visible_gpus())
    if kind == "cuda" and cfg.generation.backend == "embedded" and cfg.generation.tp_size > 1:
        problems.append(f"generation.tp_size={cfg.generation.tp_size} with cluster.device_type='cuda': the embedded "
                        "engine runs on one GPU (tensor parallel generation needs generation.backend=sglang)")
    if cfg.cluster.n_nodes > 1 and local and not cfg.dry_run:
        problems.append(f"cluster.n_nodes={cfg.cluster.n_nodes}: launcher.type=local starts processes on this host "
                        "only; use launcher.type=ray or slurm, or dry_run=true to see the placement on several nodes")
    elif kind == "cpu" and local and not cfg.dry_run and cfg.launcher.pin_cpus and n > len(os.sched_getaffinity(0)):
        problems.append(f"cluster.n_devices={n} but this process may use {len(os.sched_getaffinity(0))} cores "
                        "(lower cluster.n_devices, or set launcher.pin_cpus=false)")
    if cfg.launcher.type == "ray" and importlib.util.find_spec("ray") is None:
        problems.append("launcher.type=ray needs Ray, an optional extra: pip install -e '.[ray]'")
    if cfg.launcher.type == "slurm" and not cfg.dry_run and (problem := sbatch_missing()):
        problems.append(problem)  # found before anything is prepared or written
    if cfg.launcher.type == "slurm" and cfg.rollout.weight_update_mode == "shm":
        # /dev/shm is one host's RAM: the job's nodes could not read what trainer 0 publishes there, and
        # the launcher, which would remove it at the end, has left before the job runs.
        problems.append("rollout.weight_update_mode='shm' publishes weights in one host's RAM, which a Slurm job's "
                        "other nodes cannot read: use rollout.weight_update_mode=disk with launcher.type=slurm")
    if cfg.rollout.weight_update_mode == "shm" and not os.access(SHARED_MEMORY, os.W_OK | os.X_OK):
        problems.append(f"rollout.weight_update_mode='shm' needs a writable {SHARED_MEMORY} (a RAM file system), which "
                        "this machine does not have; use rollout.weight_update_mode=disk")
    if cfg.model.path and not cfg.dry_run and not os.path.isfile(os.path.join(cfg.model.path, "config.json")):
        problems.append(f"model.path={cfg.model.path!r} is not a Hugging Face model directory (no config.json)")
    elif cfg.model.path and not cfg.dry_run and (missing := missing_tokenizer_files(cfg.model.path)):
        # Every process loads the tokenizer from the model directory; found here, not in their logs.
        problems.append(f"model.path={cfg.model.path!r} has no tokenizer: missing {', '.join(missing)} (save the "
                        "model's tokenizer into that directory with save_pretrained)")
    return problems


def _rollout(cfg: RunConfig) -> list[str]:
    problems = []
    if cfg.rollout.weight_update_mode in ("distributed", "ipc") and not cfg.rollout.interrupt:
        # A bucket is loaded as it arrives (SGLang's semantics). Without a pause a server would admit
        # requests between two buckets and decode them on a mix of old and new weights.
        problems.append(f"rollout.weight_update_mode='{cfg.rollout.weight_update_mode}' needs rollout.interrupt=true: "
                        "the weights arrive in several buckets, and only paused servers take no request between two "
                        "of them")
    if cfg.rollout.keep_weights_every and cfg.rollout.weight_update_mode != "disk":
        problems.append(f"rollout.keep_weights_every={cfg.rollout.keep_weights_every} keeps published weights on disk, "
                        f"which rollout.weight_update_mode='{cfg.rollout.weight_update_mode}' does not write (or removes "
                        "at the end): use rollout.weight_update_mode=disk")
    if cfg.recover.retries and not (cfg.checkpoint.every_steps or cfg.checkpoint.every_minutes):
        problems.append(f"recover.retries={cfg.recover.retries} restarts a run from its last checkpoint, and this run "
                        "saves none before its end: set checkpoint.every_steps or checkpoint.every_minutes")
    if cfg.algorithm.group_size > MAX_N:
        # A group is one request with n=group_size, which the server refuses mid-run.
        problems.append(f"algorithm.group_size={cfg.algorithm.group_size} exceeds the generation server's limit of "
                        f"{MAX_N} samples per prompt (sampling_params.n)")
    if cfg.recover.retries and cfg.launcher.type == "slurm":
        problems.append("recover.retries restarts the processes the launcher watches, and a Slurm job runs on its own: "
                        "requeue the job with resume=auto instead (docs/reliability.md)")
    return problems


def graph_problems(cfg: RunConfig, graph: Graph) -> list[str]:
    problems = []
    bounds = cfg.algorithm.success_rate_range
    if bounds is not None and (len(bounds) != 2 or not 0 <= bounds[0] <= bounds[1] <= 1):
        problems.append(f"algorithm.success_rate_range={list(bounds)} must be [low, high] with 0 ≤ low ≤ high ≤ 1")
    if graph.colocated and not cfg.rollout.interrupt:
        # The servers are paused for the trainer's turn; the update that follows it continues them.
        problems.append(f"generation and training share mesh {format_mesh(graph.trainer_mesh)} (colocated), which "
                        "needs rollout.interrupt=true: the servers pause for each train step and go on at the "
                        "weight update that follows it")
    if cfg.rollout.weight_update_mode == "ipc" and not graph.colocated:
        # A handle opens memory of the sender's own devices, on its own host.
        problems.append(f"rollout.weight_update_mode='ipc' hands the servers handles to trainer rank 0's memory: it "
                        f"needs generation on the trainer's devices (colocated: graph.{graph.generate.name}.mesh equal "
                        f"to the batch nodes' mesh, or '|' in the allocation); use disk, shm or distributed")
    if graph.colocated and cfg.cluster.device_type == "cuda" and cfg.rollout.weight_update_mode == "distributed":
        # NCCL refuses a communicator with two ranks on one GPU, which trainer 0 and a server there would be.
        problems.append("rollout.weight_update_mode='distributed' with generation and training colocated on cuda: NCCL "
                        "cannot broadcast between two processes on one GPU; use rollout.weight_update_mode=ipc, shm or "
                        "disk")
    layout = graph.train.layout  # the trainer ranks' (a node on a mesh of its own has replicas)
    dp = layout.dp if layout is not None else len(graph.trainer_mesh)  # TP/PP ranks share their data
    most = math.ceil(cfg.algorithm.batch_size / max(dp, 1))
    if cfg.algorithm.n_minibatches > most:
        problems.append(f"algorithm.n_minibatches={cfg.algorithm.n_minibatches} exceeds the {most} prompt group(s) "
                        f"a trainer rank can get from algorithm.batch_size={cfg.algorithm.batch_size} over {dp} rank(s)")
    for node in graph.batch_nodes:
        if node.micro_batch_tokens <= cfg.algorithm.max_new_tokens:
            # A sequence is a prompt plus up to max_new_tokens answer tokens and is never split.
            problems.append(f"graph.{node.name}.micro_batch_tokens={node.micro_batch_tokens} cannot hold one sequence of "
                            f"a prompt and algorithm.max_new_tokens={cfg.algorithm.max_new_tokens} answer tokens")
    if cfg.algorithm.kl_coef > 0 and graph.input(graph.train, "ref_logprobs") is None:
        problems.append(f"algorithm.kl_coef={cfg.algorithm.kl_coef} needs the train node '{graph.train.name}' to read "
                        "ref_logprobs from an inference node with role ref")
    critic = graph.critic_train
    if critic is not None and graph.input(critic, "values") is None:
        problems.append(f"the critic's train node '{critic.name}' must read values, from an inference node with role "
                        "critic (its values before the update, for the clipped value loss)")
    # (a frozen role keeps every weight: only the trained role's engine matters)
    megatron = [n.name for n in graph.batch_nodes if n.engine == "megatron" and n.role == graph.train.role]
    if cfg.training.lora.rank and megatron:
        problems.append(f"training.lora.rank={cfg.training.lora.rank}: LoRA trains on engine torch only in this version "
                        f"(graph.{megatron[0]}.engine=megatron); megatron-core's own LoRA is not wired in")
    for node in graph.batch_nodes:
        if node.role == "critic" and node.engine != "torch":
            problems.append(f"node '{node.name}': the critic runs on engine torch only in this version "
                            f"(graph.{node.name}.engine={node.engine})")
    if cfg.algorithm.prox_logp == "loglinear":
        for meaning in ("prox_logprobs", "versions"):
            if graph.input(graph.train, meaning) is None:
                problems.append(f"algorithm.prox_logp=loglinear needs the train node '{graph.train.name}' to read "
                                f"{meaning} (without prox_logprobs the loss is naive PPO, with no π_prox to approximate)")
    return problems + judge_problems(cfg, graph) + algorithm_problems(cfg) + zero_mismatch_problems(cfg, graph)


def zero_mismatch_problems(cfg: RunConfig, graph: Graph) -> list[str]:
    """training.zero_mismatch computes π_prox as the embedded servers' batch-invariant decoding
    computed π_behav (training/exact_prox.py): refused, by key, where that is not what sampled the
    tokens or where there is no π_prox."""
    if not cfg.training.zero_mismatch:
        return []
    algo, train = cfg.algorithm, graph.train.name
    refusals = [
        (cfg.generation.backend != "embedded", f"generation.backend={cfg.generation.backend}: the servers' kernels are "
                                               "not areal_flow's own, whose forward the trainer reproduces"),
        (not cfg.batch_invariant_servers, f"generation.deterministic={cfg.generation.deterministic} at "
                                          f"rollout.max_staleness={cfg.rollout.max_staleness}: an answer's logprobs "
                                          "then depend on its batch; set generation.deterministic=true"),
        (graph.input(graph.train, "prox_logprobs") is None, f"the train node '{train}' reads no prox_logprobs"),
        (not algo.decoupled, "algorithm.decoupled=false has no π_prox"),
        (algo.prox_logp != "recompute", f"algorithm.prox_logp={algo.prox_logp}: π_prox is then approximated"),
        (graph.input(graph.train, "versions") is None, f"the train node '{train}' reads no versions (which request "
                                                       "sampled each token)"),
        (graph.generate.takes_turns, f"graph.{graph.generate.name} rolls out through an environment or an agent; "
                                     "one-turn answers only")]
    return [f"training.zero_mismatch=true: {why}" for refused, why in refusals if refused]


def judge_problems(cfg: RunConfig, graph: Graph) -> list[str]:
    """A judge's template names only the dataset fields it reads and {response}; held-out evaluation
    needs a reward node that no judge feeds."""
    problems = []
    for node in graph.judges:
        where = f"graph.{node.name}.template"
        try:
            names = template_fields(node.template or "", where)
        except DatasetError as e:
            problems.append(f"node '{node.name}': {e}")
            continue
        fields = graph.dataset_inputs(node)
        problems += [f"node '{node.name}': {where} names {{{name}}}, which is neither a dataset field the node reads "
                     f"(graph.{node.name}.inputs: {', '.join(fields)}) nor {{response}}"
                     for name in names if name not in (*fields, "response")]
    evaluates = cfg.eval_at_start or cfg.eval_at_end or cfg.eval.every_versions
    if graph.judges and evaluates and graph.eval_reward is None:
        judged = ", ".join(f"'{n.name}' reads {graph.reference(n)} from '{graph.producers[graph.reference(n)]}'"
                           for n in graph.rewards)
        problems.append("eval_at_start/eval_at_end/eval.every_versions need a reward node whose reference is a dataset "
                        f"field: held-out evaluation does not call judges ({judged})")
    return problems


def algorithm_problems(cfg: RunConfig) -> list[str]:
    """Rules between the algorithm's fields, and the names of losses, estimators and shapers."""
    from areal_flow.algorithms.registry import name_problem

    algo, problems = cfg.algorithm, []
    for key in ("reward_norm", "adv_norm"):
        norm = getattr(algo, key)
        if norm.leave_one_out and norm.mean_level != "group":
            problems.append(f"algorithm.{key}.leave_one_out=true needs algorithm.{key}.mean_level=group, "
                            f"not {norm.mean_level}")
    if algo.c_clip is not None and algo.policy_loss == "cispo":
        problems.append(f"algorithm.c_clip={algo.c_clip}: the dual clip is PPO's; cispo has no clipped branch to bound")
    problems += correction_problems(algo)
    if algo.kl_target is not None and algo.kl_coef == 0:
        problems.append(f"algorithm.kl_target={algo.kl_target} adapts algorithm.kl_coef, which is 0: set its "
                        "initial value")
    if algo.overlong_tokens is not None and algo.overlong_tokens > algo.max_new_tokens:
        problems.append(f"algorithm.overlong_tokens={algo.overlong_tokens} exceeds algorithm.max_new_tokens="
                        f"{algo.max_new_tokens}")
    for kind, key in (("policy_loss", "policy_loss"), ("adv_estimator", "adv_estimator")):
        if (why := name_problem(kind, getattr(algo, key), f"algorithm.{key}")) is not None:
            problems.append(why)
    for i, name in enumerate(algo.reward_shapers):
        if (why := name_problem("reward_shaper", name, f"algorithm.reward_shapers[{i}]")) is not None:
            problems.append(why)
    return problems


def correction_problems(algo) -> list[str]:
    """The off-policy correction's keys: each bound it does not read is refused by key, as is
    clip_behav where naive PPO's clip of π_θ/π_behav is not defined (docs/algorithms.md)."""
    from areal_flow.algorithms.correction_table import DEFAULTS, KEYS, configured

    name, problems = algo.correction, []
    params = configured(algo)
    for bound, key in KEYS.items():
        if getattr(algo, key) is not None and bound not in params.reads:
            problems.append(f"algorithm.{key}={getattr(algo, key)} does not apply to algorithm.correction={name}, "
                            f"which reads {', '.join('algorithm.' + KEYS[b] for b in params.reads)}")
    if algo.correction_level not in DEFAULTS[name].levels:
        problems.append(f"algorithm.correction_level={algo.correction_level}: algorithm.correction={name} is defined "
                        "per token only (sequence level: tis, mis)")
    if params.low is not None and params.high is not None and params.low > params.high:
        problems.append(f"algorithm.behav_weight_floor={params.low} exceeds algorithm.behav_weight_cap={params.high}"
                        f" (algorithm.correction={name})")
    if algo.clip_behav:
        refusals = [(algo.policy_loss == "cispo", "policy_loss=cispo has no clipped branch to add it to"),
                    (algo.importance_level == "sequence", "importance_level=sequence (GSPO): the sequence's ratio is "
                                                          "not the token's π_θ/π_behav"),
                    (not algo.decoupled, "decoupled=false is naive PPO, already clipped against π_behav")]
        problems += [f"algorithm.clip_behav=true: {why}" for refused, why in refusals if refused]
    return problems


def check_model(graph: Graph, model_path: str, gen_tp: int = 1, zero_mismatch: bool = False) -> None:
    """Raise ConfigError when the batch nodes' layout cannot split this model (TP must divide its
    heads, PP its layers), generation's tensor parallel its attention heads, or training.zero_mismatch
    needs the servers' own forward for a model it does not compute: found before any process starts,
    not in a trainer rank's or a server's log."""
    layout = graph.train.layout  # the trainer nodes' one layout; a node on a mesh of its own is data parallel
    if (layout is None or (layout.tp == 1 and layout.pp == 1)) and gen_tp == 1 and not zero_mismatch:
        return
    model = load_model_config(model_path)
    problems = []
    if layout is not None:
        where = f"graph.{graph.trainer_nodes[0].name}.parallel with model {model_path}"
        problems += layout_problems(layout, n_devices=None, model=model, where=where)
    if model.num_attention_heads % gen_tp:
        problems.append(f"generation.tp_size={gen_tp} with model {model_path}: does not divide the model's "
                        f"{model.num_attention_heads} attention heads")
    if zero_mismatch:
        from areal_flow.generation.engine.decode import unsupported  # (torch: only where asked)

        if why := unsupported(model):
            problems.append(f"training.zero_mismatch=true with model {model_path}: the generation engine's own "
                            f"forward, which it reproduces, does not compute this model ({why})")
    if problems:
        raise ConfigError(problems)


def check_run(cfg: RunConfig, graph: Graph) -> None:
    """Raise ConfigError listing every problem of a composed config whose graph is valid."""
    problems = check_ranges(cfg) + _machine(cfg) + _rollout(cfg) + graph_problems(cfg, graph)
    if "jsonl" not in cfg.metrics.backends:
        problems.append(f"metrics.backends={list(cfg.metrics.backends)} must include jsonl: the progress display, the "
                        "plots and `python -m areal_flow.status` read metrics.jsonl")
    problems += generation_problems(cfg.generation, len(graph.generate.mesh or ()))
    if problems:
        raise ConfigError(problems)


def validate(cfg: RunConfig) -> Graph:
    """The validated graph of a composed config: raise ConfigError or GraphError listing every
    problem of its keys, its graph and the rules between its fields."""
    check_known_keys(cfg)
    graph = graph_from_config(cfg, builtin_names())
    check_run(cfg, graph)
    return graph


def check_rewards(cfg: RunConfig, graph: Graph, console: Console) -> None:
    """Every reward node's function resolves, and a `code` node's sandbox can isolate programs (or
    the recipe opted out): checked at start, with the isolation in force printed."""
    problems = []
    for node in graph.rewards:
        if node.fn == AGENT_FN:  # the agent's reward: check_agent
            continue
        try:
            fn = resolve(node.fn, cfg.sandbox)  # a code node's sandbox probes its isolation here
            if isinstance(fn, CodeReward):
                console.print(f"reward node {node.name}: {fn.sandbox.describe()}", highlight=False)
        except (SandboxUnavailable, ValueError) as e:
            problems.append(f"node '{node.name}' (graph.{node.name}.fn={node.fn}): {e}")
    if problems:
        raise ConfigError(problems)


def check_agent(graph: Graph, group_size: int, console: Console) -> None:
    """An agent's rollouts: the function imports and is async, the openai client is installed, its
    roles split a group, and a reward node with `fn: agent` has an agent to give it its reward.
    ConfigError naming the key."""
    node = graph.generate
    takers = [n.name for n in graph.rewards if n.fn == AGENT_FN]
    if node.agent is None:
        if node.agent_roles:
            raise ConfigError([f"graph.{node.name}.agent_roles: the roles of an agent, but graph.{node.name}.agent "
                               "names no agent"])
        if takers:
            raise ConfigError([f"graph.{name}.fn=agent: the reward the agent returns, but graph.{node.name}.agent "
                               "names no agent" for name in takers])
        return
    from areal_flow.agents.runner import import_openai, load_agent

    try:
        load_agent(node.agent, f"graph.{node.name}.agent")
        import_openai()
    except ValueError as e:
        raise ConfigError([str(e) if str(e).startswith("graph.") else f"graph.{node.name}.agent: {e}"]) from None
    if problem := roles_problem(node.agent_roles, group_size):
        raise ConfigError([f"graph.{node.name}.agent_roles={list(node.agent_roles)}: {problem}"])
    console.print(f"generate node {node.name}: agent {node.agent}, {node.agent_wall_seconds:g} s a rollout", highlight=False)


def roles_problem(roles: list[str], group_size: int) -> str | None:
    """What is wrong with an agent's roles for groups of `group_size` samples, or None."""
    if len(set(roles)) != len(roles):
        return "the roles must differ"
    if bad := [r for r in roles if not re.fullmatch(r"[A-Za-z0-9_-]{1,32}", str(r))]:
        return f"a role is 1-32 letters, digits, _ or -, got {bad[0]!r}"
    if roles and group_size % len(roles):
        return (f"algorithm.group_size={group_size} must be a multiple of the {len(roles)} roles (each rollout of a "
                "group gives a sample of every role)")
    return None


def check_tokenizer(cfg: RunConfig, model_path: str) -> None:
    """dataset.chat_template needs a tokenizer that has one: found here, not in the controller's log."""
    if cfg.dataset.chat_template:
        from areal_flow.models.tokenizer import load_tokenizer

        check_chat_template(load_tokenizer(model_path), model_path)


def staleness_warning(cfg: RunConfig) -> str | None:
    """A line to print at launch when η is past what the recipe was shown to hold
    (rollout.staleness_shown), else None: the run goes on, its user told."""
    shown, eta = cfg.rollout.staleness_shown, cfg.rollout.max_staleness
    if shown is None or eta <= shown:
        return None
    return (f"rollout.max_staleness={eta}: recipe {cfg.recipe or '(none)'} was shown to end as well as synchronous "
            f"training only up to η = {shown} (rollout.staleness_shown; docs/staleness_study.md); past it, AReaL's "
            f"objective ended lower at η = 8 than at η = 0 in the staleness study (docs/benchmarks.md)")
