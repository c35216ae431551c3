"""Checks the launcher runs before any process starts: keys a '+' override adds past the schema,
and a model.path whose config.json does not load."""

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from areal_flow.config.validate import ConfigError, check_known_keys, check_model_config, model_context, unknown_keys
from areal_flow.launch import CONF_DIR
from areal_flow.runtime.spec import typed

RECIPES = sorted(p.stem for p in (CONF_DIR / "recipe").glob("*.yaml"))


def composed(tmp_path, *overrides):
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        return compose("config", overrides=[f"output_dir={tmp_path}/out", *overrides])


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_shipped_recipe_has_only_known_keys(tmp_path, recipe):
    assert unknown_keys(typed(composed(tmp_path, f"recipe={recipe}"))) == []


def test_keys_added_with_plus_are_named_with_their_full_path(tmp_path):
    # typed() kept them (the merge checks no keys of a node that already has the schema's type);
    # every process, reading config.yaml back untyped, died of them with a traceback.
    cfg = typed(composed(tmp_path, "+foo.bar=1", "+algorithm.eps_clp=0.1", "+graph.reward.tiemout=2",
                         "+graph.reward.weights={a: 1}"))
    with pytest.raises(ConfigError) as e:
        check_known_keys(cfg)
    assert sorted(e.value.problems) == sorted([
        "foo: unknown key, the config (RunConfig) has no field 'foo'",
        "algorithm.eps_clp: unknown key, 'algorithm' (AlgorithmConfig) has no field 'eps_clp'; "
        "did you mean algorithm.eps_clip?",
        "graph.reward.tiemout: unknown key, 'graph.reward' (RewardNodeConfig) has no field 'tiemout'; "
        "did you mean graph.reward.timeout?",
        # A key of another kind of node is named as that kind's (config/nodes.py).
        "graph.reward.weights: unknown key, 'graph.reward' (RewardNodeConfig) has no field 'weights'; "
        "weights is a key of combine nodes, not of a reward node",
    ])
    check_known_keys(typed(composed(tmp_path, "algorithm.eps_clip=0.1")))  # a known key: nothing to say


def model_dir(tmp_path: Path, text: str) -> Path:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(text)
    return tmp_path / "model"


def test_a_model_config_that_is_not_json_is_named_with_the_parse_error(tmp_path):
    model = model_dir(tmp_path, '{"model_type": "qwen2",\n  "hidden_size": 8,\n')
    with pytest.raises(ConfigError) as e:
        check_model_config(str(model))
    (problem,) = e.value.problems
    assert problem.startswith(f"model.path: {model}/config.json is not valid JSON (")
    assert "line 3 column 1" in problem


def test_a_model_config_transformers_cannot_load_is_named(tmp_path):
    model = model_dir(tmp_path, json.dumps({"model_type": "no_such_architecture"}))
    with pytest.raises(ConfigError) as e:
        check_model_config(str(model))
    (problem,) = e.value.problems
    assert problem.startswith(f"model.path: {model}/config.json is not a config transformers.AutoConfig can load")
    assert "no_such_architecture" in problem


def test_a_loadable_model_config_and_no_model_path_pass(tmp_path):
    check_model_config(None)
    check_model_config(str(tmp_path))  # no config.json: check_run reports that where the model must be here
    model = model_dir(tmp_path, json.dumps({"model_type": "qwen2", "hidden_size": 8, "num_attention_heads": 2,
                                            "num_key_value_heads": 1, "num_hidden_layers": 1}))
    check_model_config(str(model))


@pytest.mark.parametrize("launcher", ["local", "ray", "slurm"])
def test_launchers_are_a_config_group_as_a_hydra_user_types_them(tmp_path, launcher):
    cfg = typed(composed(tmp_path, f"launcher={launcher}"))
    assert cfg.launcher.type == launcher and unknown_keys(cfg) == []
    # launcher.type= on its own still works, and a group's keys take overrides on top.
    assert typed(composed(tmp_path, f"launcher.type={launcher}")).launcher.type == launcher
    if launcher == "slurm":
        assert typed(composed(tmp_path, "launcher=slurm", "launcher.slurm_time=1:00:00")).launcher.slurm_time == "1:00:00"


def test_the_context_length_is_read_from_config_json_without_transformers(tmp_path):
    assert model_context(str(model_dir(tmp_path, '{"model_type": "qwen2", "max_position_embeddings": 512}'))) == 512
    nested = tmp_path / "vl"
    nested.mkdir()
    (nested / "model").mkdir()
    (nested / "model" / "config.json").write_text('{"model_type": "qwen2", "text_config": {"max_position_embeddings": 64}}')
    assert model_context(str(nested / "model")) == 64  # a multimodal config keeps it under text_config
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text('{"model_type": "qwen2"}')
    assert model_context(str(bare)) == 32768  # not said: transformers' default for the type, as before
    (bare / "config.json").write_text("[1]")
    with pytest.raises(ConfigError, match=r"graph.judge.model: .*config.json is not a JSON object"):
        model_context(str(bare), "graph.judge.model")


def test_zero_mismatch_is_refused_by_key_where_the_servers_forward_did_not_sample_the_tokens(tmp_path):
    from areal_flow.run.checks import validate

    validate(typed(composed(tmp_path, "training.zero_mismatch=true", "rollout.max_staleness=0")))  # deterministic
    validate(typed(composed(tmp_path, "training.zero_mismatch=true", "generation.deterministic=true")))
    with pytest.raises(ConfigError) as e:
        validate(typed(composed(tmp_path, "training.zero_mismatch=true", "rollout.max_staleness=2",
                                "algorithm.prox_logp=loglinear", "algorithm.decoupled=false")))
    assert sorted(e.value.problems) == sorted([
        "training.zero_mismatch=true: generation.deterministic=None at rollout.max_staleness=2: an answer's logprobs "
        "then depend on its batch; set generation.deterministic=true",
        "training.zero_mismatch=true: algorithm.decoupled=false has no π_prox",
        "training.zero_mismatch=true: algorithm.prox_logp=loglinear: π_prox is then approximated"])
    with pytest.raises(ConfigError) as e:
        validate(typed(composed(tmp_path, "recipe=tiny_arith_tool", "training.zero_mismatch=true",
                                "generation.deterministic=true")))
    assert e.value.problems == ["training.zero_mismatch=true: graph.generate rolls out through an environment or an "
                                "agent; one-turn answers only"]


def test_zero_mismatch_is_refused_for_a_model_the_engines_own_forward_does_not_compute(tmp_path):
    from areal_flow.run.checks import check_model
    from areal_flow.graph.dag import graph_from_config

    graph = graph_from_config(typed(composed(tmp_path)))
    model = model_dir(tmp_path, json.dumps({"model_type": "gpt2", "n_embd": 8, "n_layer": 1, "n_head": 2}))
    check_model(graph, str(model))  # nothing asks for the engine's forward
    with pytest.raises(ConfigError) as e:
        check_model(graph, str(model), zero_mismatch=True)
    assert e.value.problems == [f"training.zero_mismatch=true with model {model}: the generation engine's own forward, "
                                "which it reproduces, does not compute this model (model_type gpt2 (not llama, qwen2))"]


def test_lora_on_the_megatron_engine_is_refused_by_key(tmp_path):
    from areal_flow.run.checks import validate

    validate(typed(composed(tmp_path, "training.lora.rank=8")))  # the torch engine: taken
    with pytest.raises(ConfigError) as e:
        validate(typed(composed(tmp_path, "recipe=tiny_arith_megatron", "training.lora.rank=8")))
    assert e.value.problems == ["training.lora.rank=8: LoRA trains on engine torch only in this version "
                                "(graph.actor_prox.engine=megatron); megatron-core's own LoRA is not wired in"]
