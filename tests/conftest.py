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


@pytest.fixture(scope="session")
def run_cache(tmp_path_factory):
    """One cache of generated data and bootstrapped base model for every end-to-end run."""
    return tmp_path_factory.mktemp("cache")


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` run only where CUDA is available; elsewhere they are skipped, saying why."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (marker `gpu`)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
