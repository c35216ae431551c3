import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core machine two spinning
    threads per process made these workloads 10-100x slower under load. Restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session", autouse=True)
def one_thread_in_child_processes():
    """The same for the processes the tests start: the launcher of an end-to-end run, whose own
    torch work is bootstrapping the base model (30 steps took 10 s on one thread and 26-76 s on
    two under load), tools, servers. The launcher still sets each of its children's own count
    (OMP_NUM_THREADS from the process's mesh). A value the user set is kept."""
    before = os.environ.get("OMP_NUM_THREADS")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    yield
    if before is None:
        os.environ.pop("OMP_NUM_THREADS", None)


@pytest.fixture(scope="session")
def run_cache(tmp_path_factory):
    """One cache of generated data and bootstrapped base model for every end-to-end run; one for
    the whole session when pytest-xdist runs it in several workers (each worker is a session of its
    own): the cache's writers take its locks and write each file whole, so they share it safely."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = tmp_path_factory.getbasetemp().parent / "cache"
        shared.mkdir(exist_ok=True)
        return shared
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session", autouse=True)
def base_models_built_ahead(request, one_thread_in_child_processes):
    """The base models the session's end-to-end runs start from, bootstrapped into run_cache by a
    process of its own from the session's start, beside the unit tests (which leave the second
    core mostly idle), rather than by the first run that needs each (~55 s on one thread). Each
    test module that launches runs declares the overrides its runs bootstrap with, besides
    run_helpers.SMALL's, in BASE_MODELS. A run that comes first waits for the model on the
    bootstrap's lock; one the builder has not reached, it builds itself, as before."""
    variants = []
    for item in request.session.items:
        if "run_cache" in item.fixturenames:
            for overrides in [(), *getattr(getattr(item, "module", None), "BASE_MODELS", ())]:
                if tuple(overrides) not in variants:
                    variants.append(tuple(overrides))
    if not variants:
        yield
        return
    cache = request.getfixturevalue("run_cache")
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import run_helpers; "
            f"run_helpers.build_base_models(run_helpers.Path({str(cache)!r}), {variants!r})")
    with open(cache / "base_models.log", "w") as log:
        builder = subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT)
    yield
    if builder.poll() is None:  # a short session: not every model was needed
        builder.kill()
    builder.wait()


@pytest.fixture(scope="session")
def eta0_run(run_cache, tmp_path_factory):
    """The directory of one finished run with run_helpers.ETA0_RUN's settings, shared by the tests
    that read it (each asserts its own things of it): the run costs ~15 s."""
    from run_helpers import ETA0_RUN, launch

    run_dir = tmp_path_factory.mktemp("eta0") / "run"
    r = launch(run_dir, run_cache, *ETA0_RUN)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return run_dir


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` run only where CUDA is available; elsewhere they are skipped, saying why.
    Tests marked `cluster` (tests/cluster: a real Slurm in network namespaces, as root; the Ray
    launcher's clusters) are a tier of their own: they run only when `-m` names them.

    The two pytest-xdist workers (pyproject's addopts) take tests as they come, `slow` ones too: two
    end-to-end runs may share the two cores, so a test that observes timing (an update cutting
    answers, a restarted server noticed) must hold under that load. (Grouping the slow tier on one
    worker made the suite 1,442 s against 1,170 s, past its 20-minute budget.)"""
    if "cluster" not in (config.getoption("markexpr") or ""):
        kept = [item for item in items if "cluster" not in item.keywords]
        if len(kept) < len(items):
            config.hook.pytest_deselected(items=[item for item in items if "cluster" in item.keywords])
            items[:] = kept
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (marker `gpu`)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
