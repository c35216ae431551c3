"""Cross-field and range checks of a composed run config, before anything starts.

OmegaConf already rejects unknown keys and wrong types; this catches values that type-check but
would hang or mislead a run (a zero batch, a mesh on cores the machine does not have, ...). Every
problem names the key to change; all of them are reported at once.
"""

from __future__ import annotations

import math
import os

from areal_flow.graph.dag import Graph

DEVICE_TYPES = ("cpu", "cuda")
LAUNCHERS = ("local",)


class ConfigError(ValueError):
    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid config:\n" + "\n".join(f"  - {p}" for p in problems))


def _ranges(cfg) -> list[str]:
    a, asy = cfg.algorithm, cfg["async"]
    rules = [
        ("total_steps", cfg.total_steps >= 1, "must be ≥ 1"),
        ("max_wall_seconds", cfg.max_wall_seconds >= 0, "must be ≥ 0 (0 = no limit)"),
        ("eval_every", cfg.eval_every >= 0, "must be ≥ 0 (0 = never)"),
        ("algorithm.group_size", a.group_size >= 2, "must be ≥ 2: a group of one sample has advantage 0"),
        ("algorithm.batch_size", a.batch_size >= 1, "must be ≥ 1"),
        ("algorithm.n_minibatches", a.n_minibatches >= 1, "must be ≥ 1"),
        ("algorithm.lr", a.lr > 0, "must be > 0"),
        ("algorithm.eps_clip", a.eps_clip > 0, "must be > 0"),
        ("algorithm.eps_clip_high", a.eps_clip_high is None or a.eps_clip_high > 0, "must be > 0 or null"),
        ("algorithm.behav_weight_cap", a.behav_weight_cap is None or a.behav_weight_cap >= 1,
         "must be ≥ 1 or null (it caps π_prox/π_behav, which is 1 for fresh samples)"),
        ("algorithm.kl_coef", a.kl_coef >= 0, "must be ≥ 0"),
        ("algorithm.temperature", a.temperature > 0, "must be > 0 (training logprobs divide by it)"),
        ("algorithm.top_p", 0 < a.top_p <= 1, "must be in (0, 1]"),
        ("algorithm.max_new_tokens", a.max_new_tokens >= 1, "must be ≥ 1"),
        ("async.max_staleness", asy.max_staleness >= 0, "must be ≥ 0 (0 = synchronous)"),
        ("async.max_concurrent", asy.max_concurrent >= 1, "must be ≥ 1"),
        ("async.rollout_workers", asy.rollout_workers >= 1, "must be ≥ 1"),
        ("dataset.n_train", cfg.dataset.n_train >= 1, "must be ≥ 1"),
        ("dataset.n_eval", cfg.dataset.n_eval >= 1, "must be ≥ 1"),
        ("cluster.n_devices", cfg.cluster.n_devices >= 1, "must be ≥ 1"),
    ]
    problems = [f"{key}={_value(cfg, key)} {why}" for key, ok, why in rules if not ok]
    for name, node in cfg.graph.items():
        if node.micro_batch_tokens < 1:
            problems.append(f"graph.{name}.micro_batch_tokens={node.micro_batch_tokens} must be ≥ 1")
        if node.type == "reward" and node.workers < 1:
            problems.append(f"graph.{name}.workers={node.workers} must be ≥ 1")
    return problems


def _value(cfg, key: str):
    node = cfg
    for part in key.split("."):
        node = node[part]
    return node


def _machine(cfg) -> list[str]:
    problems = []
    kind, n = cfg.cluster.device_type, cfg.cluster.n_devices
    if kind not in DEVICE_TYPES:
        problems.append(f"cluster.device_type={kind!r} must be one of {', '.join(DEVICE_TYPES)}")
    elif kind == "cpu" and cfg.launcher.pin_cpus and n > len(os.sched_getaffinity(0)):
        problems.append(f"cluster.n_devices={n} but this process may use {len(os.sched_getaffinity(0))} cores "
                        "(lower cluster.n_devices, or set launcher.pin_cpus=false)")
    elif kind == "cuda":
        import torch

        if n > torch.cuda.device_count():
            problems.append(f"cluster.n_devices={n} but torch sees {torch.cuda.device_count()} CUDA devices")
    if cfg.launcher.type not in LAUNCHERS:
        problems.append(f"launcher.type={cfg.launcher.type!r}: only {', '.join(LAUNCHERS)} exists in this version")
    if cfg.model.path and not os.path.isfile(os.path.join(cfg.model.path, "config.json")):
        problems.append(f"model.path={cfg.model.path!r} is not a Hugging Face model directory (no config.json)")
    return problems


def _graph(cfg, graph: Graph) -> list[str]:
    problems = []
    dp = len(graph.trainer_mesh)
    most = math.ceil(cfg.algorithm.batch_size / max(dp, 1))
    if cfg.algorithm.n_minibatches > most:
        problems.append(f"algorithm.n_minibatches={cfg.algorithm.n_minibatches} exceeds the {most} prompt group(s) "
                        f"a trainer rank can get from algorithm.batch_size={cfg.algorithm.batch_size} over {dp} rank(s)")
    if cfg.algorithm.kl_coef > 0 and not any(n.role == "ref" for n in graph.batch_nodes):
        problems.append("algorithm.kl_coef > 0 needs an inference node with role ref whose output the train node reads")
    return problems


def check_run(cfg, graph: Graph) -> None:
    """Raise ConfigError listing every problem of a composed config whose graph is valid."""
    problems = _ranges(cfg) + _machine(cfg) + _graph(cfg, graph)
    if problems:
        raise ConfigError(problems)
