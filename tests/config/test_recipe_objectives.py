"""Every shipped recipe runs AReaL's decoupled objective (a π_prox node the train node reads, the
behaviour weight masked by AReaL's correction, no clip against π_behav), or says in its header
why not, with the figure (a line `# objective: ...`)."""

import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from areal_flow.launch import CONF_DIR
from areal_flow.runtime.spec import typed

RECIPES = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "recipes").glob("*.yaml"))


def objective_of(recipe: str, tmp_path) -> tuple[str, bool, bool, bool]:
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        raw = compose("config", overrides=[f"recipe={recipe}", f"output_dir={tmp_path}", f"cache_dir={tmp_path}"])
    cfg = typed(raw)
    # The actor's train node as written (the GPU recipes' meshes come from an allocation at launch).
    train = [n for n in cfg.graph.values() if n.type == "train" and n.role != "critic"]
    reads_prox = len(train) == 1 and "prox_logprobs" in train[0].inputs
    return cfg.algorithm.correction, cfg.algorithm.clip_behav, cfg.algorithm.decoupled, reads_prox


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_recipe_runs_areals_objective_or_says_why_not(recipe, tmp_path):
    header = [line for line in (Path(CONF_DIR).parent / "recipes" / f"{recipe}.yaml").read_text().splitlines()
              if line.startswith("#")]
    why = [line for line in header if line.startswith("# objective:")]
    if objective_of(recipe, tmp_path) == ("areal", False, True, True):
        assert not why, f"recipes/{recipe}.yaml says why it is not AReaL's objective, but it is"
    else:
        assert why and re.search(r"\d", why[0]), (
            f"recipes/{recipe}.yaml does not run AReaL's objective: its header needs '# objective: ...' with the figure")


def test_the_check_can_fail(tmp_path):
    # naive PPO (no π_prox) is told apart from AReaL's objective
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        raw = compose("config", overrides=["algorithm.decoupled=false", f"output_dir={tmp_path}", f"cache_dir={tmp_path}"])
    assert typed(raw).algorithm.decoupled is False
