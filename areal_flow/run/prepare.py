"""Prepare: the data and the base model, read or made once before any process starts, and the
checks that need them (the model's fit to the graph, its tokenizer, the reward functions)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from rich.console import Console

from areal_flow.config.schema import RunConfig
from areal_flow.config.validate import ConfigError, check_model_config
from areal_flow.data.loading import dataset_paths, load_prompts
from areal_flow.generation.sglang_backend import sglang_missing
from areal_flow.graph.dag import Graph, graph_from_config
from areal_flow.run.checks import check_model, check_rewards, check_tokenizer


@dataclass(frozen=True)
class Prepared:
    """What every process of the run reads: absolute paths."""

    run_dir: str
    model_path: str  # the actor's starting checkpoint (a Hugging Face directory with its tokenizer)
    train_path: str
    eval_path: str


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


def prepare_model(cfg: RunConfig) -> str:
    """The base model's directory: model.path, or a tiny model bootstrapped into the cache once."""
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


def prepare(cfg: RunConfig, graph: Graph, console: Console) -> Prepared:
    """Check what a real start needs (SGLang installed, the reward functions), then read the data
    and make the model; raise ConfigError or DatasetError naming what is wrong."""
    if cfg.generation.backend == "sglang" and (problem := sglang_missing()):
        raise ConfigError([problem])
    check_rewards(cfg, graph, console)
    train_path, eval_path = prepare_data(cfg, graph.dataset_input(graph.generate))
    model_path = prepare_model(cfg)
    check_model_config(cfg.model.path)
    check_model(graph, model_path, cfg.generation.tp_size)
    check_tokenizer(cfg, model_path)
    return Prepared(run_dir=os.path.abspath(cfg.output_dir), model_path=model_path, train_path=train_path,
                    eval_path=eval_path)
