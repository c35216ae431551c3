"""A recipe's multi-turn settings checked at launch (run/env_checks.py: check_names, check_env, the
graph's own rules, the schema's ranges): each refusal names the key, before any process starts."""

import io
import os
from pathlib import Path

import pytest
import transformers
from hydra import compose, initialize_config_dir
from rich.console import Console

from areal_flow.config.validate import ConfigError
from areal_flow.graph.dag import GraphError
from areal_flow.launch import CONF_DIR
from areal_flow.models.tokenizer import CHARS, CODE_CHARS, build_char_tokenizer
from areal_flow.run.checks import validate
from areal_flow.run.env_checks import check_env, check_names
from areal_flow.runtime.spec import typed

MULTI_TURN = ["+graph.generate.env=python_tool",
              "graph.generate.outputs=[prompt_ids,output_ids,behav_logprobs,versions,loss_mask]",
              "graph.actor_train.inputs=[prompt_ids,output_ids,behav_logprobs,versions,prox_logprobs,rewards,loss_mask]"]


def config(*overrides: str):
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        cfg = typed(compose("config", overrides=["output_dir=/tmp/unused", *overrides]))
    return cfg, validate(cfg)


def model(tmp_path, chars: str, positions: int = 384) -> str:
    """A model directory as check_env reads it: a character tokenizer and a config."""
    build_char_tokenizer(chars, chat=chars == CODE_CHARS).save_pretrained(tmp_path)
    transformers.Qwen2Config(vocab_size=128, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1,
                             max_position_embeddings=positions).save_pretrained(tmp_path)
    return str(tmp_path)


def rows(tmp_path) -> str:
    """A training file of two arithmetic rows, as tiny_arith writes them."""
    path = tmp_path / "train.jsonl"
    path.write_text('{"id": "train-0", "prompt": "1+2=", "answer": "3"}\n{"id": "train-1", "prompt": "2+2=", "answer": "4"}\n')
    return str(path)


def check(cfg, graph, model_path, train_path=None) -> str:
    out = io.StringIO()
    check_env(cfg, graph, model_path, Console(file=out), train_path or rows(Path(model_path)))
    return out.getvalue()


def test_a_python_tool_with_a_tokenizer_that_writes_its_tags_passes_and_says_so(tmp_path):
    cfg, graph = config(*MULTI_TURN, "graph.generate.max_turns=3")
    assert "generate node generate: environment python_tool, up to 3 turns" in check(cfg, graph, model(tmp_path, CODE_CHARS))


def test_an_environment_that_does_not_exist_is_refused_naming_the_key(tmp_path):
    cfg, graph = config(*MULTI_TURN[1:], "+graph.generate.env=calculator")
    with pytest.raises(ConfigError, match=r"graph.generate.env: no environment 'calculator'; built in: code_feedback, python_tool"):
        check(cfg, graph, model(tmp_path, CODE_CHARS))


def test_settings_the_environment_does_not_take_are_refused_naming_the_key(tmp_path):
    cfg, graph = config(*MULTI_TURN, "+graph.generate.env_settings.timeout=3")
    with pytest.raises(ConfigError, match=r"graph.generate.env=python_tool with graph.generate.env_settings: "
                                          r"python_tool: .*'timeout'"):
        check(cfg, graph, model(tmp_path, CODE_CHARS))


def test_a_stop_string_the_tokenizer_cannot_write_is_refused(tmp_path):
    cfg, graph = config(*MULTI_TURN)  # the arithmetic tokenizer has digits, + = ; # and space only
    with pytest.raises(ConfigError, match=r"cannot write the stop string '</python>'"):
        check(cfg, graph, model(tmp_path, CHARS))


def test_a_token_budget_past_the_models_context_is_refused(tmp_path):
    cfg, graph = config(*MULTI_TURN, "graph.generate.max_trajectory_tokens=1000")
    with pytest.raises(ConfigError, match=r"graph.generate.max_trajectory_tokens=1000: larger than the model's "
                                          r"context \(384 positions"):
        check(cfg, graph, model(tmp_path, CODE_CHARS))


def test_max_turns_below_one_and_an_env_on_another_node_are_refused():
    with pytest.raises(ConfigError, match=r"graph.generate.max_turns"):
        config(*MULTI_TURN, "graph.generate.max_turns=0")
    # Only a generate node has the key (config/nodes.py); on a judge, the graph says whose it is.
    with pytest.raises(ConfigError, match=r"graph.actor_prox.env: unknown key, .*env is a key of generate nodes, "
                                          r"not of an inference node"):
        config("+graph.actor_prox.env=python_tool")


def test_an_environment_without_a_loss_mask_is_refused():
    """Observations trained as the policy's tokens is the bug the loss mask exists for: a recipe
    with an environment that does not write it, or a train node that does not read it, is refused."""
    with pytest.raises(GraphError, match=r"graph.generate.env.*must write loss_mask: add it to graph.generate.outputs"):
        config("+graph.generate.env=python_tool")
    with pytest.raises(GraphError, match=r"must read loss_mask \(add it to graph.actor_train.inputs\)"):
        config(*MULTI_TURN[:2])
    config(*MULTI_TURN)  # both: accepted


ENVS = str(Path(__file__).parent)


@pytest.fixture
def test_envs_importable(monkeypatch):
    monkeypatch.syspath_prepend(ENVS)


def test_an_environment_that_reads_a_field_of_its_row_when_made_is_made_from_a_real_row(tmp_path, test_envs_importable):
    """Made from an empty row, Answered's `row["answer"]` in __init__ crashed the launch with a raw
    KeyError; made from the first training row, as a rollout makes it, it passes."""
    cfg, graph = config(*MULTI_TURN[1:], "+graph.generate.env=answered_env:Answered")
    assert "environment answered_env:Answered, up to 4 turns" in check(cfg, graph, model(tmp_path, CODE_CHARS))


def test_an_environment_that_reads_a_field_the_rows_lack_is_refused_naming_it_and_the_field(tmp_path,
                                                                                        test_envs_importable):
    cfg, graph = config(*MULTI_TURN[1:], "+graph.generate.env=answered_env:Answered",
                        "+graph.generate.env_settings.field=solution")
    path = model(tmp_path, CODE_CHARS)
    with pytest.raises(ConfigError) as e:
        check(cfg, graph, path)
    (line,) = str(e.value).splitlines()[-1:]
    assert f"graph.generate.env=answered_env:Answered: made from the first row of {os.path.join(path, 'train.jsonl')}, " \
           "it reads the field 'solution', which the rows lack (they have id, prompt, answer; dataset.fields lists " \
           "the fields read from the data)" in line


def test_an_environment_whose_constructor_raises_is_refused_naming_it_and_the_error(tmp_path, test_envs_importable):
    cfg, graph = config(*MULTI_TURN[1:], "+graph.generate.env=answered_env:Answered",
                        "+graph.generate.env_settings.field=7")
    with pytest.raises(ConfigError, match=r"graph.generate.env=answered_env:Answered: made from the first row of .*"
                                          r"train.jsonl, it raised answered_env.py:\d+ in __init__: ZeroDivisionError"):
        check(cfg, graph, model(tmp_path, CODE_CHARS))


@pytest.mark.parametrize("name, said", [
    ("no_such_module:Env", r"graph.generate.env: cannot import 'no_such_module' \(No module named 'no_such_module'\)"),
    ("answered_env:Nope", r"graph.generate.env: 'answered_env' has no callable 'Nope'"),
    ("broken_import_env:Env", r"graph.generate.env.*broken_import_env.*NameError: name 'undefined_name' is not defined"),
])
def test_an_environment_that_does_not_import_is_refused_naming_the_key_without_the_model(name, said,
                                                                                        test_envs_importable):
    cfg, graph = config(*MULTI_TURN[1:], f"+graph.generate.env={name}")
    with pytest.raises(ConfigError, match=said):
        check_names(graph)  # no model, no data, no tokenizer: what run/prepare.py checks before the bootstrap


def test_check_names_passes_a_recipe_whose_environment_imports(test_envs_importable):
    cfg, graph = config(*MULTI_TURN[1:], "+graph.generate.env=answered_env:Answered")
    check_names(graph)
    check_names(config()[1])  # no environment, no agent
