"""tools/gpu_check.sh (the one command run on a lent GPU machine) and tools/gpu_requirements.txt (what
it installs from the wheelhouse that tools/gpu_wheels.sh builds), checked on a CPU machine."""

import ast
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "tools" / "gpu_check.sh"

# The GPU image has these, with their own dependencies.
IMAGE = {"torch", "transformers", "tokenizers", "safetensors", "numpy", "huggingface-hub", "triton"}
# Imported only when enabled (a launcher, a metrics writer, a data format, a backend, a benchmark or an agent).
OPTIONAL = {"ray", "wandb", "tensorboard", "datasets", "pyarrow", "sglang", "trl", "accelerate", "openai"}
STEPS = ["install", "bench_generation", "bench_engine", "gpu_smoke", "gpu_smoke_code", "pytest_gpu", "bench_long",
         "bench_longtail"]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def listed() -> dict[str, Requirement]:
    lines = (line.split("#", 1)[0].strip() for line in (ROOT / "tools" / "gpu_requirements.txt").read_text().splitlines())
    return {norm(r.name): r for r in map(Requirement, filter(None, lines))}


def image_closure() -> set[str]:
    """IMAGE and the distributions they require (extras left out), as installed here."""
    seen, todo = set(), list(IMAGE)
    while todo:
        name = norm(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for line in requires:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def imported_modules(path: Path, everywhere: bool) -> set[str]:
    """Top-level names of the absolute imports of a file: all of them, or (everywhere=False) those run
    when the module is imported, i.e. outside functions and classes."""
    tree = ast.parse(path.read_text())
    nodes = ast.walk(tree) if everywhere else module_level(tree.body)
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


def module_level(body):
    for node in body:
        yield node
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            for field in ("body", "orelse", "finalbody"):
                yield from module_level(getattr(node, field, []))
            for handler in getattr(node, "handlers", []):
                yield from module_level(handler.body)


def missing_from_the_list(modules: dict[str, set[str]], local: set[str]) -> list[str]:
    to_dist = importlib.metadata.packages_distributions()
    covered = set(listed()) | image_closure()
    missing = []
    for module, files in sorted(modules.items()):
        if module in sys.stdlib_module_names or module in local or module == "areal_flow":
            continue
        dists = {norm(d) for d in to_dist.get(module, [])}
        if dists & OPTIONAL or module in OPTIONAL:
            continue
        if not dists:
            missing.append(f"{module} (no installed distribution provides it; imported by {sorted(files)[0]})")
        elif not dists & covered:
            missing.append(f"{module} ({'/'.join(sorted(dists))}, imported by {sorted(files)[0]})")
    return missing


def test_both_scripts_parse():
    for script in ("gpu_check.sh", "gpu_wheels.sh"):
        subprocess.run(["bash", "-n", str(ROOT / "tools" / script)], check=True)


def test_every_package_areal_flow_imports_is_in_the_gpu_list_or_comes_with_torch_or_transformers():
    modules: dict[str, set[str]] = {}
    for path in (ROOT / "areal_flow").rglob("*.py"):
        for module in imported_modules(path, everywhere=True):
            if not (path.parent / f"{module}.py").exists():  # a script's sibling (the sandbox's init) is ours
                modules.setdefault(module, set()).add(str(path.relative_to(ROOT)))
    assert not missing_from_the_list(modules, set()), (
        "add these to tools/gpu_requirements.txt (and rebuild the wheelhouse with tools/gpu_wheels.sh): "
        f"{missing_from_the_list(modules, set())}")


def test_every_package_pytest_collects_or_the_gpu_steps_run_is_in_the_gpu_list():
    """`pytest -m gpu` imports every test module to collect it; the benchmarks import tools/ modules."""
    modules: dict[str, set[str]] = {}
    local = set()
    for folder in ("tests", "tools"):
        for path in (ROOT / folder).rglob("*.py"):
            local.add(path.stem)
            for module in imported_modules(path, everywhere=False):
                modules.setdefault(module, set()).add(str(path.relative_to(ROOT)))
    assert not missing_from_the_list(modules, local), missing_from_the_list(modules, local)


def test_the_list_pins_what_pyproject_pins_and_leaves_out_what_the_image_has():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {}
    for line in project["dependencies"] + project["optional-dependencies"]["dev"]:
        req = Requirement(line)
        declared[norm(req.name)] = req
    gpu = listed()
    for name, req in gpu.items():
        pins = [s.version for s in req.specifier if s.operator == "=="]
        assert len(pins) == 1, f"{req}: the GPU list pins one version"
        if name in declared:
            assert declared[name].specifier.contains(pins[0]), f"{req} against pyproject.toml's {declared[name]}"
    assert not set(gpu) & (IMAGE | OPTIONAL)
    # Every runtime dependency of pyproject.toml is in the GPU list, in the image or optional.
    runtime = {norm(Requirement(line).name) for line in project["dependencies"]}
    assert not runtime - set(gpu) - IMAGE - OPTIONAL, runtime - set(gpu) - IMAGE - OPTIONAL


def test_on_the_gpu_machine_it_refuses_to_run_without_out(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA H100'\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", GPU_CHECK_SKIP_INSTALL="1", GPU_CHECK_STEP_TIMEOUT="1")
    done = subprocess.run(["bash", str(CHECK)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "OUT is not set" in done.stderr and "refuses" in done.stderr


@pytest.mark.slow
def test_on_a_cpu_machine_it_records_every_step_writes_the_json_and_fails(tmp_path):
    """Each step capped at 2 s: pytest's collection alone takes longer, so that step times out; the
    engine benchmark needs CUDA; nothing is installed. The check still ends, writes its results and
    exits 1."""
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), GPU_CHECK_SKIP_INSTALL="1", GPU_CHECK_STEP_TIMEOUT="2",
               PYTHON=sys.executable)
    start = time.monotonic()
    done = subprocess.run(["bash", str(CHECK)], env=env, capture_output=True, text=True, timeout=120)
    assert time.monotonic() - start < 60, done.stdout[-2000:]
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    result = json.loads((out / "gpu_check.json").read_text())
    assert set(result) >= {"date", "device", "torch", "transformers", "steps", "pytest"}
    assert result["device"] == "no NVIDIA GPU (nvidia-smi not found)" and result["ok"] is False
    steps = {s["name"]: s for s in result["steps"]}
    assert [s["name"] for s in result["steps"]] == STEPS
    for s in result["steps"]:
        assert set(s) >= {"name", "command", "rc", "seconds", "status", "tail"}
        assert s["status"] in {"passed", "failed", "timeout", "skipped"}
        assert len(s["tail"]) <= 40
    assert steps["install"]["status"] == "skipped" and steps["install"]["reason"] == "GPU_CHECK_SKIP_INSTALL=1"
    assert steps["pytest_gpu"]["status"] == "timeout" and steps["pytest_gpu"]["rc"] in (124, 137)
    assert "-m gpu" in steps["pytest_gpu"]["command"]
    for needs_cuda in STEPS[1:5] + STEPS[6:]:
        assert steps[needs_cuda]["status"] in {"failed", "timeout"}
    assert set(result["pytest"]) >= {"passed", "failed", "skipped", "errors"}
    log = (out / "gpu_check.log").read_text()
    assert "== pytest_gpu: timeout" in log and "== bench_engine:" in log
    # What the lent machine returns from $OUT: 8 files at most, plainly named, none over 16 MiB.
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8 and {p.name for p in files} >= {"gpu_check.json", "gpu_check.log", "pip_list.txt"}
    for p in files:
        assert re.fullmatch(r"[A-Za-z0-9._-]+", p.name) and p.stat().st_size < 16 * 2**20
        assert len(p.relative_to(out).parts) <= 3
