"""The GPU recipes' documented allocations, each placed by a dry run without a GPU.

Each recipe's header lists its allocations as `#   nodes=N: OVERRIDES`; every one must place, and
the dry run must put each generation server and trainer rank on the node and GPUs that the
allocation string means (devices numbered across nodes of 8 GPUs, generation first).
"""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCUMENTED = re.compile(r"^#\s+nodes=(\d+): (.+)$", re.MULTILINE)
PER_NODE = 8


def documented(recipe: str) -> list[tuple[int, list[str]]]:
    text = (REPO / "recipes" / f"{recipe}.yaml").read_text()
    return [(int(n), shlex.split(overrides)) for n, overrides in DOCUMENTED.findall(text)]


def sizes(part: str) -> dict[str, int]:
    return {"d": 1, "t": 1, "p": 1} | {k: int(v) for k, v in re.findall(r"([dtp])(\d+)", part.split(":")[1])}


RECIPES = ("code_7b", "code_7b_lora", "math_1.5b", "math_1.5b_lora")
CASES = [(recipe, n, overrides) for recipe in RECIPES for n, overrides in documented(recipe)]


def test_each_recipe_documents_one_two_and_sixteen_nodes():
    assert sorted((r, n) for r, n, _ in CASES) == [(r, n) for r in RECIPES for n in (1, 2, 16)]


@pytest.mark.parametrize("recipe, nodes, overrides", CASES, ids=[f"{r}-{n}nodes" for r, n, _ in CASES])
@pytest.mark.slow  # 1.1-1.6 s: the full suite runs it; the fast tier keeps its 3 minutes
def test_the_dry_run_places_every_process_where_the_allocation_says(tmp_path, recipe, nodes, overrides):
    r = subprocess.run([sys.executable, "-m", "areal_flow.launch", f"recipe={recipe}", *overrides, "dry_run=true"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    allocation = next(o.split("=", 1)[1] for o in overrides if o.startswith("allocation="))
    gen, train = (sizes(p.strip()) for p in allocation.split("+"))
    placed = dict(re.findall(r"^  ((?:gen_server|trainer)\d+)\s+(.+)$", r.stdout, re.MULTILINE))

    def where(device: int, count: int) -> str:
        node, first = divmod(device, PER_NODE)
        gpus = ",".join(map(str, range(first, first + count))) if count < 3 else f"{first}-{first + count - 1}"
        return f"gpu {gpus}" if nodes == 1 else f"node {node:<3} gpu {gpus}"

    n_gen = gen["d"] * gen["t"]
    expected = {f"gen_server{i}": where(i * gen["t"], gen["t"]) for i in range(gen["d"])}
    expected |= {f"trainer{k}": where(n_gen + k, 1) for k in range(train["d"] * train["t"] * train["p"])}
    assert placed == expected
    assert (f"placement on {nodes} nodes:" if nodes > 1 else "placement:") in r.stdout
    assert r.stdout.count("-m sglang.launch_server") == gen["d"] and f"--tp-size {gen['t']} " in r.stdout
    layout = f"d{train['d']}p{train['p']}t{train['t']}"
    assert f"graph.actor_train.parallel={layout}" in r.stdout
    if recipe.endswith("_lora"):  # the adapters on the torch engine
        assert "graph.actor_train.engine=torch" in r.stdout
