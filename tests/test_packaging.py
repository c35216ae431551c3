"""What a non-editable install (`pip install .`, i.e. a wheel) ships, and that it runs.

The repository keeps the Hydra config dir conf/ and the recipes recipes/ at its top level
(conf/recipe is a link to recipes/). Pinned down here: the wheel carries them inside the
package, as areal_flow/conf/ with every recipe as a real file in areal_flow/conf/recipe/; an
install of that wheel, in a fresh venv and run from a directory that is not the repository, finds
them (a dry run prints the graph and its placement, an unknown recipe fails); and pyproject's
explicit `packages` list names every package under areal_flow/ and every config group, since
setuptools ships nothing that list leaves out.
"""

import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Build from a copy: no build/ or egg-info written into the checkout, and no stale build/lib
# files from an earlier build slipping into the wheel.
NOT_COPIED = {".git", "build", "dist", "outputs", "multirun", "wandb", ".pytest_cache", ".benchmarks"}


def run(*argv: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return subprocess.run(list(argv), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def expected_wheel_yaml() -> set[str]:
    """Wheel paths of every YAML file the launcher reads: conf/ (not through its recipe link) and recipes/."""
    conf, recipes = REPO / "conf", REPO / "recipes"
    files = {f"areal_flow/conf/{p.relative_to(conf).as_posix()}" for p in conf.rglob("*.yaml")}
    files |= {f"areal_flow/conf/recipe/{p.relative_to(recipes).as_posix()}" for p in recipes.rglob("*.yaml")}
    return files


def test_pyproject_lists_every_package_and_config_group():
    tomllib = pytest.importorskip("tomllib")
    setuptools_cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    expected = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "areal_flow").rglob("__init__.py")}
    expected |= {"areal_flow.conf", "areal_flow.conf.recipe"}
    expected |= {".".join(("areal_flow", "conf", *d.relative_to(REPO / "conf").parts))
                 for d in (REPO / "conf").rglob("*") if d.is_dir() and not d.is_symlink()}
    expected |= {".".join(("areal_flow", "conf", "recipe", *d.relative_to(REPO / "recipes").parts))
                 for d in (REPO / "recipes").rglob("*") if d.is_dir()}
    assert sorted(setuptools_cfg["packages"]) == sorted(expected)
    assert setuptools_cfg["package-dir"] == {"areal_flow.conf": "conf", "areal_flow.conf.recipe": "recipes"}
    assert (REPO / "conf" / "recipe").resolve() == (REPO / "recipes").resolve()


@pytest.mark.slow
def test_the_wheel_ships_conf_and_recipes_and_launches_outside_the_repository(tmp_path):
    src, wheels, venv, elsewhere = (tmp_path / n for n in ("src", "wheels", "venv", "elsewhere"))
    shutil.copytree(REPO, src, symlinks=True, ignore=lambda d, names: {
        n for n in names if n == "__pycache__" or n.endswith(".egg-info") or (Path(d) == REPO and n in NOT_COPIED)})
    r = run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
            str(src), "-w", str(wheels), cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = wheels.glob("areal_flow-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "areal_flow/conf/config.yaml" in names and "areal_flow/conf/recipe/tiny_arith.yaml" in names
    yaml_in_wheel = [n for n in names if n.endswith(".yaml")]
    assert sorted(yaml_in_wheel) == sorted(expected_wheel_yaml())  # each once, none missing

    # System site-packages give torch, hydra and the rest, so nothing is downloaded; pip runs from
    # there too. --ignore-installed: the editable install there is neither replaced nor removed.
    r = run(sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv), cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    python = str(venv / "bin" / "python")
    # Run from a virtual environment, --system-site-packages gives the BASE interpreter's packages,
    # not that environment's: a .pth file adds this interpreter's own site-packages (after the new
    # venv's, and without running their .pth files, so the editable install stays out of sight).
    r = run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp_path)
    (Path(r.stdout.strip()) / "outer_site_packages.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    r = run(python, "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", str(wheel), cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr

    elsewhere.mkdir()
    r = run(python, "-c", "import areal_flow, areal_flow.launch as l; print(areal_flow.__file__); print(l.CONF_DIR)",
            cwd=elsewhere)
    assert r.returncode == 0, r.stderr
    package_file, conf_dir = (Path(line).resolve() for line in r.stdout.split())
    assert package_file.is_relative_to(venv.resolve()) and not package_file.is_relative_to(REPO)
    assert conf_dir == package_file.parent / "conf"

    r = run(python, "-m", "areal_flow.launch", "dry_run=true", cwd=elsewhere)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "generate" in r.stdout and "actor_train" in r.stdout and "placement" in r.stdout

    r = run(python, "-m", "areal_flow.launch", "recipe=does_not_exist", "dry_run=true", cwd=elsewhere)
    assert r.returncode != 0
    assert "does_not_exist" in r.stdout + r.stderr
