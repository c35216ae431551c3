"""Model directories (saved with save_pretrained) and a running server, shared by the tests."""

from __future__ import annotations


import pytest
import torch
from generation_helpers import ModelDirs, load_reference, make_model_dirs, running_server, torch_threads

from areal_flow.generation.server import GenerationServer


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
