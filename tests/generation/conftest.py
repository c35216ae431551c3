"""Model directories (saved with save_pretrained) and a running server, shared by the tests."""

from __future__ import annotations


import pytest
from generation_helpers import ModelDirs, make_model_dirs, torch_threads

from areal_flow.generation.server import GenerationServer, serve


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> ModelDirs:
    with torch_threads(1):
        return make_model_dirs(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def server_a(model_dirs: ModelDirs) -> GenerationServer:
    server, thread = serve(model_dirs.a, max_batch_size=64)
    yield server
    server.stop()
    thread.join(timeout=10)
    assert not thread.is_alive()
