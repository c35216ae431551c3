"""Prepare: the data and the base model, read or made once before any process starts, and the
checks that need them (the model's fit to the graph, its tokenizer, the reward functions)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from rich.console import Console

from areal_flow.config.schema import RunConfig
from areal_flow.config.validate import ConfigError, check_model_config, model_context
from areal_flow.data.dataset import DatasetError, load_rows
from areal_flow.data.loading import dataset_paths, load_prompts, prompt_room, row_format
from areal_flow.data.templates import check_chat_template
from areal_flow.generation.sglang_backend import sglang_missing
from areal_flow.graph.dag import Graph, graph_from_config
from areal_flow.run.checks import check_agent, check_model, check_rewards, check_tokenizer
from areal_flow.run.env_checks import check_env, check_names


@dataclass(frozen=True)
class Prepared:
    """What every process of the run reads: absolute paths."""

    run_dir: str
    model_path: str  # the actor's starting checkpoint (a Hugging Face directory with its tokenizer)
    train_path: str
    eval_path: str
    judge_models: dict[str, str] = field(default_factory=dict)  # each judge -> its model dir, never updated


def prepare_data(cfg: RunConfig, prompt_key: str | None = None) -> tuple[str, str]:
    """Absolute paths of the train and held-out data, generated for tiny_arith and tiny_code; every row is read
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
    from areal_flow.models.bootstrap import ensure_base_model

    m = cfg.model
    return ensure_base_model(os.path.join(cfg.cache_dir, "models"), arch=dict(m.arch) or None,
                             steps=m.bootstrap_steps, lr=m.bootstrap_lr, batch_size=m.bootstrap_batch_size,
                             seed=cfg.dataset.seed, heldout=(cfg.dataset.n_eval, cfg.dataset.seed), progress=True,
                             device=cfg.cluster.device_type, task=m.bootstrap_task or cfg.dataset.name)


def prepare(cfg: RunConfig, graph: Graph, console: Console) -> Prepared:
    """Check what a real start needs (SGLang installed, the environment's and the agent's imports,
    the reward functions), then read the data and make the model; raise ConfigError or
    DatasetError naming what is wrong."""
    if cfg.generation.backend == "sglang" and (problem := sglang_missing()):
        raise ConfigError([problem])
    check_names(graph)  # before the data and the model: a first run's bootstrap takes minutes
    check_rewards(cfg, graph, console)
    prompt_key = graph.dataset_input(graph.generate)
    train_path, eval_path = prepare_data(cfg, prompt_key)
    model_path = prepare_model(cfg)
    check_model_config(cfg.model.path)
    check_model(graph, model_path, cfg.generation.tp_size, cfg.training.zero_mismatch)
    check_tokenizer(cfg, model_path)
    check_env(cfg, graph, model_path, console, train_path)
    check_agent(graph, cfg.algorithm.group_size, console)
    check_prompt_room(cfg, model_path, prompt_key, ((train_path, cfg.dataset.train_split),
                                                    (eval_path, cfg.dataset.eval_split)), console)
    return Prepared(run_dir=os.path.abspath(cfg.output_dir), model_path=model_path, train_path=train_path,
                    eval_path=eval_path, judge_models=prepare_judges(cfg, graph, model_path, train_path))


def check_prompt_room(cfg: RunConfig, model_path: str, prompt_key: str, splits, console: Console) -> None:
    """Every prompt, templated and tokenized as the run will, fits the model's context with its
    answer: drawn, a longer one would stop the run at a generation server, naming no file. It is
    refused naming its file and line, or (dataset.long_prompts=skip) left out, said here once."""
    from areal_flow.models.tokenizer import load_tokenizer  # here: transformers takes seconds to import

    if (room := prompt_room(cfg, model_path)) is None:
        return
    tokenizer = load_tokenizer(model_path)
    for path, split in splits:
        skipped: list[str] = []
        kept = load_prompts(cfg.dataset, path, split, prompt_key, tokenizer, room, skipped)
        if skipped and not kept:
            raise DatasetError(f"{path}: every prompt is over the {room} tokens the model's context leaves beside "
                               "algorithm.max_new_tokens (dataset.long_prompts=skip left none)")
        if skipped:
            console.print(f"dataset.long_prompts=skip: {len(skipped)} of {len(kept) + len(skipped)} rows of {path} "
                          f"left out, their prompts over {room} tokens (the first: {skipped[0]})",
                          highlight=False, markup=False)


def prepare_judges(cfg: RunConfig, graph: Graph, model_path: str, train_path: str) -> dict[str, str]:
    """Each judge's model dir (graph.<judge>.model, or the run's starting model), checked: its
    config and tokenizer load, and every training row's judge prompt fits its context before any answer."""
    models = {}
    for node in graph.judges:
        path, key = os.path.abspath(node.model) if node.model else model_path, f"graph.{node.name}.model"
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ConfigError([f"node '{node.name}': {key}={node.model!r} is not a Hugging Face model directory "
                               "(no config.json)"])
        from areal_flow.models.tokenizer import load_tokenizer, missing_tokenizer_files  # transformers: seconds

        if missing := missing_tokenizer_files(path):
            raise ConfigError([f"node '{node.name}': {key}={path!r} has no tokenizer: missing {', '.join(missing)}"])
        positions = model_context(path, key)
        tokenizer = load_tokenizer(path)
        try:
            if node.chat_template:
                check_chat_template(tokenizer, path, f"graph.{node.name}.chat_template", f"graph.{node.name}.template")
            check_judge_room(cfg, node, tokenizer, positions, train_path, path)
        except DatasetError as e:
            raise ConfigError([f"node '{node.name}': {e}"]) from None
        models[node.name] = path
    return models


def check_judge_room(cfg: RunConfig, node, tokenizer, positions: int, train_path: str, path: str) -> None:
    """DatasetError naming the longest training row whose judge prompt, with no answer yet, leaves
    the judge less than its answer budget of its `positions`."""
    from areal_flow.rollout.judge import prompt_ids

    ds, budget = cfg.dataset, node.max_new_tokens or cfg.algorithm.max_new_tokens
    places: list[str] = []
    rows = load_rows(train_path, list(ds.fields), row_format(ds.name), ds.train_split, places)
    longest, where = max(((len(prompt_ids(tokenizer, node, row, "")), place) for row, place in zip(rows, places)),
                         default=(0, ""))
    if longest + budget > positions:
        key = f"graph.{node.name}.max_new_tokens" if node.max_new_tokens else "algorithm.max_new_tokens"
        raise DatasetError(f"{where} renders to {longest} judge tokens before any answer; with {key}={budget} that "
                           f"exceeds the judge's {positions} positions (max_position_embeddings of {path})")
