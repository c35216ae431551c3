"""The checks of a multi-turn recipe's environment and of an agent's function, at launch.

`check_names` runs before the data and the model are made (a first run bootstraps its model for
minutes): the environment a recipe names and the agent's function import, or the run stops naming
the key. `check_env` runs once the data and the model exist: the environment is made as a rollout
makes it, from a real row of the training data (an environment that reads `row["answer"]` when
made would fail on an empty row), its settings taken, its tools able to run here
(Environment.check); the tokenizer can write its stop strings; the token budget fits the context.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console

from areal_flow.config.schema import RunConfig
from areal_flow.config.validate import ConfigError, model_context
from areal_flow.graph.dag import Graph


def check_names(graph: Graph) -> None:
    """The generate node's environment (its module and class) and agent (its module and function)
    import: ConfigError naming the key, before any data or model is made."""
    node = graph.generate
    try:
        if node.env is not None:
            from areal_flow.envs.registry import resolve_env

            resolve_env(node.env, f"graph.{node.name}.env")
        if node.agent is not None:
            from areal_flow.agents.runner import load_agent

            load_agent(node.agent, f"graph.{node.name}.agent")
    except ValueError as e:
        raise ConfigError([str(e)]) from None
    except Exception as e:  # noqa: BLE001 - the user's module raised while it was imported
        from areal_flow.rollout.turns import error_line

        what = "env" if node.env is not None else "agent"
        raise ConfigError([f"graph.{node.name}.{what}={getattr(node, what)}: importing it raised "
                           f"{error_line(e)}"]) from None


def made_env(cfg: RunConfig, graph: Graph, row: dict[str, Any], where: str) -> Any:
    """The generate node's environment made from `row` (`where` names it: the first row of the
    training file) and checked (Environment.check); ConfigError naming the key, the environment
    and, for a field the rows lack, the field."""
    from areal_flow.envs.registry import resolve_env
    from areal_flow.rollout.turns import error_line

    node, key = graph.generate, f"graph.{graph.generate.name}"
    try:
        env = resolve_env(node.env, f"{key}.env")(dict(row), sandbox=cfg.sandbox, **dict(node.env_settings))
        env.check()
    except (ValueError, TypeError) as e:
        raise ConfigError([str(e) if str(e).startswith(key) else f"{key}.env={node.env} with {key}.env_settings: {e}"])
    except KeyError as e:
        if e.args and e.args[0] not in row:
            raise ConfigError([f"{key}.env={node.env}: made from {where}, it reads the field {e.args[0]!r}, which the "
                               f"rows lack (they have {', '.join(map(str, row))}; dataset.fields lists the fields "
                               "read from the data)"]) from None
        raise ConfigError([f"{key}.env={node.env}: made from {where}, it raised {error_line(e)}"]) from None
    except Exception as e:  # noqa: BLE001 - the user's environment: its bug, named
        raise ConfigError([f"{key}.env={node.env}: made from {where}, it raised {error_line(e)}"]) from None
    return env


def check_env(cfg: RunConfig, graph: Graph, model_path: str, console: Console, train_path: str) -> None:
    """A multi-turn generate node's environment: made from the first row of `train_path` as a
    rollout makes it (`made_env`); the tokenizer can write its stop strings; the trajectory's token
    budget fits the model's context. Raise ConfigError naming each key that is wrong."""
    node = graph.generate
    if node.env is None:
        return
    from areal_flow.data.loading import load_prompts
    from areal_flow.models.tokenizer import load_tokenizer

    key = f"graph.{node.name}"
    rows = load_prompts(cfg.dataset, train_path, cfg.dataset.train_split, graph.dataset_input(node))
    env = made_env(cfg, graph, rows[0], f"the first row of {train_path}")
    problems = []
    tokenizer = load_tokenizer(model_path)
    for stop in env.stop:
        ids = tokenizer.encode(stop, add_special_tokens=False)
        if tokenizer.unk_token_id in ids or tokenizer.decode(ids) != stop:
            problems.append(f"{key}.env={node.env}: the tokenizer of {model_path} cannot write the stop string "
                            f"{stop!r} (it reads back as {tokenizer.decode(ids)!r}): no turn could end there")
    context = model_context(model_path)
    if node.max_trajectory_tokens is not None and node.max_trajectory_tokens > context:
        problems.append(f"{key}.max_trajectory_tokens={node.max_trajectory_tokens}: larger than the model's context "
                        f"({context} positions, {model_path})")
    if problems:
        raise ConfigError(problems)
    console.print(f"generate node {node.name}: environment {node.env}, up to {node.max_turns} turns", highlight=False)
