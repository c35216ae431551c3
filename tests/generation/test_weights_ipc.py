"""Weights by handle (rollout.weight_update_mode=ipc; SGLang's /update_weights_from_tensor): this
process, as trainer rank 0, sends a model's weights in buckets of shared-memory handles (CUDA IPC on
a GPU) to an embedded server in another process, which then generates exactly what the same weights
loaded from disk generate; a bucket that does not fit, or is not tensor handles, is refused naming
why, and nothing of it is loaded."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from generation_helpers import ModelDirs, http_call
from test_weights_broadcast import GREEDY, SAMPLED, answer, from_disk

from areal_flow.generation.client.generation_client import wait_healthy
from areal_flow.generation.engine.checkpoint import load_checkpoint
from areal_flow.runtime.ports import free_ports
from areal_flow.training.engine import bucketed
from areal_flow.weights.ipc import IpcSender
from areal_flow.weights.sender import Server, WeightTransferError

REPO = Path(__file__).resolve().parents[2]
# Server processes of their own: the full suite runs these, the fast tier does not.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(model_dirs: ModelDirs, tmp_path_factory) -> str:
    [port] = free_ports(1)
    log = tmp_path_factory.mktemp("ipc_server") / "server.log"
    proc = subprocess.Popen([sys.executable, "-m", "areal_flow.generation.server", "--model-path", model_dirs.a,
                             "--port", str(port), "--num-threads", "1", "--weight-version", "0", "--log-level",
                             "WARNING"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, timeout=90)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_weights_sent_by_handle_generate_what_the_same_weights_from_disk_generate(server, model_dirs):
    from_disk(server, model_dirs.a, 0)
    before = answer(server, GREEDY)
    state = load_checkpoint(model_dirs.b)
    buckets = list(bucketed(iter(state.items()), sum(t.numel() * t.element_size() for t in state.values()) // 3))
    report = IpcSender([Server("gen_server0", server)], timeout=60).send(buckets, 5)
    assert (report.buckets, report.tensors) == (len(buckets), len(state)) and report.buckets >= 3
    assert http_call(server, "GET", "/get_weight_version")[2] == {"weight_version": "5"}
    sent = [answer(server, s) for s in (GREEDY, SAMPLED)]
    from_disk(server, model_dirs.b, 6)
    disk = [answer(server, s) for s in (GREEDY, SAMPLED)]
    assert [(ids, lps) for ids, lps, _ in sent] == [(ids, lps) for ids, lps, _ in disk]  # bit for bit
    assert sent[0][2] == [5] * 12 and sent[0][0] != before[0]


def test_a_bucket_that_does_not_fit_or_is_not_handles_is_refused_and_nothing_loads(server, model_dirs):
    from_disk(server, model_dirs.a, 0)
    sender = IpcSender([Server("gen_server0", server)], timeout=60)
    with pytest.raises(WeightTransferError, match=r"gen_server0: .*model.layers.0.mlp.nope.weight"):
        sender.send([[("model.layers.0.mlp.nope.weight", torch.ones(2))]], 7)
    status, _, body = http_call(server, "POST", "/update_weights_from_tensor",
                                {"serialized_named_tensors": ["gASVHQAAAAAAAACMBXBvc2l4lIwGc3lzdGVtlJOUjAJpZJSFlFKULg=="]})
    assert status == 400 and "a serialized tensor may not name posix.system" in body["message"]
    status, _, body = http_call(server, "POST", "/update_weights_from_tensor", {"serialized_named_tensors": "x"})
    assert status == 400 and "serialized_named_tensors must be a list of one serialized bucket" in body["message"]
    assert http_call(server, "GET", "/get_weight_version")[2] == {"weight_version": "0"}


@pytest.mark.gpu
def test_on_a_gpu_weights_go_by_cuda_ipc_handle_bit_for_bit(model_dirs, tmp_path):
    """The trainer's tensors on GPU 0, a server on the same GPU (colocated): CUDA IPC handles."""
    [port] = free_ports(1)
    proc = subprocess.Popen([sys.executable, "-m", "areal_flow.generation.server", "--model-path", model_dirs.a,
                             "--port", str(port), "--device", "cuda", "--dtype", "float32", "--weight-version", "0"],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "server.log", "w"))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, timeout=120)
        state = {name: t.cuda() for name, t in load_checkpoint(model_dirs.b).items()}
        IpcSender([Server("gen_server0", url)], timeout=60).send(list(bucketed(iter(state.items()), 1 << 16)), 3)
        sent = [answer(url, s) for s in (GREEDY, SAMPLED)]
        from_disk(url, model_dirs.b, 4)
        disk = [answer(url, s) for s in (GREEDY, SAMPLED)]
        assert [(ids, lps) for ids, lps, _ in sent] == [(ids, lps) for ids, lps, _ in disk]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
