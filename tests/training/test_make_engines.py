"""A trainer rank's engines as the config asks for them: device, number format, activation
checkpointing (the device is the CPU here; gpu-marked: the same on CUDA)."""

import numpy as np
import pytest
import torch
from engine_helpers import make_seqs, neg_mean_logprob, save_tiny_qwen2
from hydra import compose, initialize_config_dir

from areal_flow.graph import graph_from_config
from areal_flow.launch import CONF_DIR
from areal_flow.runtime.spec import RunSpec, typed
from areal_flow.training.build import make_engines


def rank_engines(model_dir: str, *overrides: str):
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        cfg = typed(compose("config", overrides=["output_dir=/tmp/unused", *overrides]))
    spec = RunSpec(run_dir="/tmp/unused", model_path=model_dir, train_path="", eval_path="", gen_ports=[],
                   controller_port=0, rollout_ports=[], trainer_ports=[0], dist_port=0, n_trainers=1, n_rollout=1)
    return make_engines(cfg, spec, graph_from_config(cfg), 0)


def test_the_cpu_default_computes_in_float32_and_the_config_turns_on_bfloat16_and_checkpointing(tmp_path):
    model_dir = save_tiny_qwen2(tmp_path / "m")
    plain = rank_engines(model_dir)["actor"]
    assert plain.device == torch.device("cpu") and not plain.options.bf16 and not plain.options.activation_checkpointing
    mixed = rank_engines(model_dir, "training.dtype=bfloat16", "training.activation_checkpointing=true")["actor"]
    assert mixed.options.bf16 and mixed.options.activation_checkpointing
    seqs = make_seqs(0, 4)
    stats = mixed.train_step(seqs, {}, neg_mean_logprob)
    assert np.isfinite(stats["loss"])
    # Master weights stay float32 under bfloat16 compute, and the logprobs the loss sees are float32.
    assert {p.dtype for p in mixed.model.parameters()} == {torch.float32}
    assert all(lp.dtype == np.float32 for lp in mixed.logprobs(seqs))


@pytest.mark.gpu
def test_on_cuda_the_rank_places_its_weights_and_optimizer_state_on_its_gpu_in_bfloat16_compute(tmp_path):
    engine = rank_engines(save_tiny_qwen2(tmp_path / "m"), "cluster.device_type=cuda")["actor"]
    assert engine.device == torch.device("cuda", 0) and engine.options.bf16
    engine.train_step(make_seqs(0, 4), {}, neg_mean_logprob)
    state = engine._optimizer.state
    assert state and all(v.device.type == "cuda" for s in state.values() for v in s.values() if v.dim() > 0)
    assert {p.device.type for p in engine.model.parameters()} == {"cuda"}
