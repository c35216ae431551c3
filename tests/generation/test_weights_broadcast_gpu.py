"""Weights by NCCL broadcast: this process as trainer rank 0 on GPU 0 sends a model's weights to an
embedded server on GPU 1, which then generates exactly what the same weights loaded from disk
generate. NCCL needs a GPU per rank: skipped with fewer than two."""

from __future__ import annotations

import os
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
from areal_flow.weights.sender import Server, WeightSender

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs")]
REPO = Path(__file__).resolve().parents[2]


def test_an_nccl_broadcast_delivers_the_weights_bit_for_bit(model_dirs: ModelDirs, tmp_path):
    torch.cuda.set_device(0)
    [port] = free_ports(1)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "areal_flow.generation.server", "--model-path", model_dirs.a,
                             "--port", str(port), "--device", "cuda", "--dtype", "float32", "--weight-version", "0"],
                            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "server.log", "w"))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, timeout=120)
        sender = WeightSender([Server("gen_server0", url)], backend="nccl", timeout=120)
        sender.connect()
        state = load_checkpoint(model_dirs.b)
        report = sender.send(list(bucketed(iter(state.items()), 1 << 16)), 3)
        assert report.tensors == len(state)
        sent = [answer(url, s) for s in (GREEDY, SAMPLED)]
        from_disk(url, model_dirs.b, 4)
        disk = [answer(url, s) for s in (GREEDY, SAMPLED)]
        assert [(ids, lps) for ids, lps, _ in sent] == [(ids, lps) for ids, lps, _ in disk]
        assert http_call(url, "GET", "/get_weight_version")[2] == {"weight_version": "4"}
        sender.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
