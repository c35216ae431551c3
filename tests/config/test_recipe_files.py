"""Recipes as files, as a user writes them (issue "Bad input III", items 1-5): a path to one's own
YAML file from any directory, with or without the package header; YAML beside it that Hydra never
reads; a mistyped node name; a reward module that does not compile. Each works, or is refused in
one line naming the file, key or node, before anything starts."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

HELM = 'apiVersion: batch/v1\nkind: Job\nmetadata:\n  name: {{ .Values.name }}\n  labels: {{- include "x" . | nindent 4 }}\n'
"""A Helm chart's template: not valid YAML."""


def launch(*args: str, cwd: Path, tmp: Path | None = None) -> subprocess.CompletedProcess:
    """The launcher as a user runs it; `tmp`: its TMPDIR, to see what it leaves there."""
    env = None if tmp is None else {**os.environ, "TMPDIR": str(tmp)}
    return subprocess.run([sys.executable, "-m", "areal_flow.launch", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def folders(tmp_path: Path) -> tuple[Path, Path]:
    """A working directory and, apart from it, a folder of the user's recipes."""
    (tmp_path / "work").mkdir()
    (tmp_path / "mine").mkdir()
    return tmp_path / "work", tmp_path / "mine"


def test_a_recipe_path_from_any_directory_extends_a_built_in_recipe(tmp_path):
    work, mine = folders(tmp_path)
    (mine / "my.yaml").write_text("# @package _global_\ndefaults:\n  - code_tiny\n  - _self_\ntotal_steps: 3\n")
    (tmp_path / "tmp").mkdir()
    r = launch(f"recipe={mine / 'my.yaml'}", "--cfg", "job", cwd=work, tmp=tmp_path / "tmp")
    assert r.returncode == 0, r.stdout + r.stderr
    job = yaml.safe_load(r.stdout)
    assert job["recipe"] == "my"  # named after its file: outputs/my/<time>
    assert job["total_steps"] == 3 and job["graph"]["reward"]["fn"] == "code"  # its key on code_tiny's graph
    assert list((tmp_path / "tmp").iterdir()) == []  # the links Hydra read through are gone


@pytest.mark.slow  # a dry run, about 1.5 s: the full suite runs it; the fast tier keeps its 3 minutes
def test_a_relative_recipe_path_runs(tmp_path):
    work, mine = folders(tmp_path)
    (mine / "my.yaml").write_text("defaults: [code_tiny, _self_]\ntotal_steps: 3\n")
    r = launch("recipe=../mine/my.yaml", "dry_run=true", f"cache_dir={tmp_path}/cache", cwd=work)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "actor_train: train [actor]" in r.stdout


@pytest.mark.slow  # two launches, about 2 s: the full suite runs it; the fast tier keeps its 3 minutes
def test_a_recipe_path_reads_its_own_file_and_the_recipes_beside_it(tmp_path):
    work, mine = folders(tmp_path)
    shipped = (Path(__file__).resolve().parents[2] / "recipes" / "tiny_arith.yaml").read_text()
    # A copy of a built-in recipe under the built-in's name is the user's file, not the built-in.
    (mine / "tiny_arith.yaml").write_text(shipped.replace("group_size: 8", "group_size: 4"))
    r = launch(f"recipe={mine / 'tiny_arith.yaml'}", "--cfg", "job", cwd=work)
    assert r.returncode == 0, r.stdout + r.stderr
    assert yaml.safe_load(r.stdout)["algorithm"]["group_size"] == 4
    (mine / "base.yaml").write_text("defaults: [tiny_arith_ppo, _self_]\nseed: 7\n")
    (mine / "child.yaml").write_text("defaults: [base, _self_]\ntotal_steps: 5\n")
    r = launch("recipe=../mine/child.yaml", "--cfg", "job", cwd=work)
    assert r.returncode == 0, r.stdout + r.stderr
    job = yaml.safe_load(r.stdout)
    assert (job["recipe"], job["seed"], job["total_steps"]) == ("child", 7, 5)
    assert "critic_train" in job["graph"]  # tiny_arith_ppo's graph, through the file beside it


def test_a_recipe_path_or_name_that_is_not_there_is_one_line(tmp_path, monkeypatch):
    from areal_flow.launch import CONF_DIR
    from areal_flow.run.recipe_files import RecipeError, recipe_args

    work, mine = folders(tmp_path)
    monkeypatch.chdir(work)
    with pytest.raises(RecipeError) as e:
        recipe_args(["recipe=tiny_arith.yaml"], CONF_DIR)
    assert str(e.value) == (f"recipe=tiny_arith.yaml: no such file ({work / 'tiny_arith.yaml'}) (the built-in recipe "
                            "is named without .yaml: recipe=tiny_arith)")
    with pytest.raises(RecipeError) as e:
        recipe_args([f"recipe={mine}"], CONF_DIR)
    assert str(e.value) == f"recipe={mine}: a folder, not a YAML file ({mine})"
    r = launch("recipe=tiny_arth", cwd=work)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert r.stderr.startswith("error: recipe=tiny_arth: no recipe of that name (recipes: areal_math, code_7b, ")
    assert "; did you mean recipe=tiny_arith? (a recipe of your own: recipe=PATH to its YAML file)" in r.stderr
    assert recipe_args(["recipe=tiny_arith", "dry_run=true"], CONF_DIR) == ["recipe=tiny_arith", "dry_run=true"]


def test_a_recipe_file_without_the_package_header_is_global(tmp_path):
    work, mine = folders(tmp_path)
    (mine / "plain.yaml").write_text("# my recipe: no header\ndefaults: [tiny_arith, _self_]\ntotal_steps: 3\n")
    r = launch(f"recipe={mine / 'plain.yaml'}", "--cfg", "job", cwd=work)
    assert r.returncode == 0, r.stdout + r.stderr
    job = yaml.safe_load(r.stdout)
    assert job["recipe"] == "plain" and job["total_steps"] == 3


@pytest.mark.slow  # two launches, about 1.5 s: the full suite runs it; the fast tier keeps its 3 minutes
def test_a_recipe_by_name_needs_no_header_and_one_under_another_package_is_one_line(tmp_path):
    work, mine = folders(tmp_path)
    (mine / "recipe").mkdir()  # by name, from a folder on the search path
    (mine / "recipe" / "plain.yaml").write_text("recipe: plain\nseed: 5\n")
    r = launch("recipe=plain", f"hydra.searchpath=[file://{mine}]", "--cfg", "job", cwd=work)
    assert r.returncode == 0, r.stdout + r.stderr
    assert yaml.safe_load(r.stdout)["seed"] == 5
    (mine / "other.yaml").write_text("# @package rollout\nmax_staleness: 1\n")
    r = launch(f"recipe={mine / 'other.yaml'}", "--cfg", "job", cwd=work)
    assert r.returncode == 2
    assert r.stderr.strip() == (f"error: recipe file {mine / 'other.yaml'}: '# @package rollout' puts its keys under "
                                "'rollout', but a recipe's keys are the run's: write '# @package _global_' or no such "
                                "line")


def test_yaml_that_hydra_never_reads_is_not_parsed(tmp_path):
    work, mine = folders(tmp_path)
    for root in (work, mine):  # a Helm chart beside the recipe, and in the working directory
        (root / "deploy" / "templates").mkdir(parents=True)
        (root / "deploy" / "templates" / "job.yaml").write_text(HELM)
    (mine / "my.yaml").write_text("defaults: [tiny_arith, _self_]\ntotal_steps: 3\n")
    r = launch("recipe=../mine/my.yaml", "--cfg", "job", cwd=work)
    assert r.returncode == 0, r.stdout + r.stderr
    assert yaml.safe_load(r.stdout)["total_steps"] == 3


@pytest.mark.slow  # two launches, about 1.5 s: the full suite runs it; the fast tier keeps its 3 minutes
def test_yaml_on_the_search_path_that_hydra_never_reads_is_not_parsed(tmp_path):
    work, _ = folders(tmp_path)
    (work / "deploy" / "templates").mkdir(parents=True)
    (work / "deploy" / "templates" / "job.yaml").write_text(HELM)
    # The working directory on the search path, its recipes in ./recipe/.
    (work / "recipe").mkdir()
    (work / "recipe" / "mine.yaml").write_text("defaults: [tiny_arith, _self_]\nseed: 9\n")
    (work / "recipe" / "broken.yaml").write_text("a: [1, 2\n")  # not chosen: never read
    r = launch("recipe=mine", "hydra.searchpath=[file://.]", "--cfg", "job", cwd=work)
    assert r.returncode == 0, r.stdout + r.stderr
    assert yaml.safe_load(r.stdout)["seed"] == 9
    r = launch("recipe=./recipe/broken.yaml", cwd=work)  # the file Hydra does read is checked
    assert r.returncode == 2
    assert r.stderr.strip() == (f"error: malformed YAML in {work / 'recipe' / 'broken.yaml'}, line 2: expected ',' "
                                "or ']', but got '<stream end>'")


def test_a_mistyped_key_in_a_recipe_file_or_on_the_command_line_names_the_likely_key(tmp_path):
    from areal_flow.launch import CONF_DIR
    from areal_flow.run.recipe_files import RecipeError, recipe_args

    work, mine = folders(tmp_path)
    (mine / "my.yaml").write_text("defaults: [tiny_arith, _self_]\nrollout: {max_stalenes: 3}\n")
    r = launch("recipe=../mine/my.yaml", "--cfg", "job", cwd=work)
    assert r.returncode == 2
    assert r.stderr.strip() == (f"error: recipe file {mine / 'my.yaml'}: rollout.max_stalenes: unknown key, 'rollout' "
                                "(RolloutConfig) has no field 'max_stalenes'; did you mean rollout.max_staleness?")
    # The same keys on the command line: one line, not Hydra's 'Could not override' and its '+' advice;
    # config groups, '+' keys (refused later, check_known_keys) and the graph's node keys pass here.
    with pytest.raises(RecipeError) as e:
        recipe_args(["rollout.max_stalenes=3", "dry_rn=true", "algorithm=dr_grpo", "graph.reward.fn=math",
                     "+foo.bar=1", "hydra.run.dir=x", "model.arch.hidden_size=8"], CONF_DIR)
    assert str(e.value) == ("rollout.max_stalenes: unknown key, 'rollout' (RolloutConfig) has no field "
                            "'max_stalenes'; did you mean rollout.max_staleness?; dry_rn: unknown key, the config "
                            "(RunConfig) has no field 'dry_rn'; did you mean dry_run?")


def test_a_mistyped_node_name_names_the_recipes_nodes_and_the_likely_one(tmp_path):
    r = launch("graph.actor_trian.mesh=1", "dry_run=true", cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert ("node 'actor_trian': the recipe has no node of that name (graph.actor_trian sets no type); its nodes: "
            "generate, reward, actor_prox, actor_train; did you mean graph.actor_train? (a new node needs "
            "graph.actor_trian.type: generate | reward | combine | inference | train)") in r.stdout
    assert "unknown type ''" not in r.stdout


def test_a_node_without_a_type_far_from_every_name_still_lists_the_nodes():
    from areal_flow.graph import GraphError
    from areal_flow.graph.dag import build_graph

    nodes = {"generate": {"type": "generate", "role": "actor", "inputs": ["prompt"], "outputs": ["output_ids"],
                          "mesh": "0"},
             "zzz": {"mesh": "1"}}
    with pytest.raises(GraphError) as e:
        build_graph(nodes, ["prompt"], 2)
    assert "node 'zzz': the recipe has no node of that name (graph.zzz sets no type); its nodes: generate (a new " \
           "node needs graph.zzz.type: " in str(e.value)


def test_a_reward_module_that_does_not_compile_is_named_in_one_line_at_launch(tmp_path):
    (tmp_path / "mymodule.py").write_text("def myfn(completion, reference)\n    return 1.0\n")
    r = launch("graph.reward.fn=mymodule:myfn", f"cache_dir={tmp_path}/cache", f"hydra.run.dir={tmp_path}/run",
               cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    assert (f"node 'reward' (graph.reward.fn=mymodule:myfn): reward function 'mymodule:myfn': cannot import "
            f"'mymodule': SyntaxError at {tmp_path / 'mymodule.py'}, line 1: expected ':'") in r.stdout
    assert not (tmp_path / "cache").exists()  # refused before the data and the base model


def test_a_module_that_raises_or_fails_an_import_while_imported_names_its_file_and_line(tmp_path, monkeypatch):
    from areal_flow.config.import_path import import_callable

    (tmp_path / "raises_mod.py").write_text("x = 1\nraise RuntimeError('no key\\nsecond line')\n")
    (tmp_path / "inner_mod.py").write_text("import os\nimport no_such_package_q\n")
    (tmp_path / "tabs_mod.py").write_text("def f(c, r):\n    x = 1\n\treturn x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError) as e:
        import_callable("raises_mod:f")
    assert str(e.value) == f"cannot import 'raises_mod': RuntimeError: no key at {tmp_path / 'raises_mod.py'}, line 2"
    with pytest.raises(ValueError) as e:
        import_callable("inner_mod:f")
    assert str(e.value) == (f"cannot import 'inner_mod' (No module named 'no_such_package_q') at "
                            f"{tmp_path / 'inner_mod.py'}, line 2")
    with pytest.raises(ValueError, match=r"cannot import 'tabs_mod': TabError at .*tabs_mod.py, line 3: "):
        import_callable("tabs_mod:f")
    with pytest.raises(ValueError) as e:
        import_callable("no_such_module_q:f")  # the module itself is not there: no place to name
    assert str(e.value) == "cannot import 'no_such_module_q' (No module named 'no_such_module_q')"
