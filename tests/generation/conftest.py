"""Model directories (saved with save_pretrained) and a running server, shared by the tests."""

from __future__ import annotations


import time

import pytest
import torch
from generation_helpers import (ModelDirs, before_every_forward, load_reference, make_model_dirs, running_server,
                                torch_threads)

from areal_flow.generation.http.server import GenerationServer, serve


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> ModelDirs:
    with torch_threads(1):
        return make_model_dirs(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def server_a(model_dirs: ModelDirs) -> GenerationServer:
    with running_server(model_dirs.a, max_batch_size=64) as server:
        yield server


@pytest.fixture(scope="module")
def ref_a(model_dirs: ModelDirs) -> torch.nn.Module:
    """Model a in plain transformers, for reference forwards."""
    return load_reference(model_dirs.a)


@pytest.fixture
def start(model_dirs: ModelDirs):
    """start(model_dir, delay=s, port=p): a real server, stopped at the end of the test."""
    started = []

    def start(path: str | None = None, *, delay: float = 0.0, port: int = 0) -> GenerationServer:
        server, thread = serve(path or model_dirs.a, port=port, max_batch_size=16)
        if delay:
            before_every_forward(server.engine, lambda *_: time.sleep(delay))
        started.append((server, thread))
        return server

    yield start
    for server, thread in started:
        server.stop()
        thread.join(timeout=10)
