"""Devices and number formats: what each process computes on, and the checks before a run starts."""

import pytest
import torch

from areal_flow.runtime.devices import TRAINER_BACKENDS, compute_dtype, cuda_problems, local_device


def test_auto_is_bfloat16_on_cuda_and_float32_on_the_cpu_and_names_map_to_dtypes():
    assert compute_dtype("auto", "cuda") == torch.bfloat16 and compute_dtype(None, "cuda") == torch.bfloat16
    assert compute_dtype("auto", "cpu") == torch.float32 and compute_dtype(None, "cpu") == torch.float32
    assert compute_dtype("half", "cuda") == torch.float16 and compute_dtype("float", "cpu") == torch.float32
    assert compute_dtype("bfloat16", "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="dtype 'fp8' is not one of auto, float32"):
        compute_dtype("fp8", "cuda")


def test_asking_for_more_gpus_than_torch_sees_names_the_key_what_was_asked_and_what_was_found():
    assert cuda_problems(1, 1) == [] and cuda_problems(4, 8) == []
    [none] = cuda_problems(1, 0)
    assert none.startswith(f"cluster.device_type='cuda' but torch {torch.__version__} sees no GPU on this machine")
    [few] = cuda_problems(8, 1)
    assert few.startswith("cluster.n_devices=8 GPUs asked for, but torch sees 1 on this machine")


def test_trainer_ranks_use_nccl_for_gpu_tensors_and_gloo_for_cpu_ones():
    assert TRAINER_BACKENDS["cpu"] == "gloo"
    # One group, two backends: each collective takes the backend of its tensors' device.
    assert set(TRAINER_BACKENDS["cuda"].split(",")) == {"cpu:gloo", "cuda:nccl"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal on a machine without a GPU")
def test_a_process_without_a_gpu_that_is_asked_for_cuda_fails_naming_what_it_sees(monkeypatch):
    assert local_device("cpu") == torch.device("cpu")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(RuntimeError, match=r"sees no GPU .*CUDA_VISIBLE_DEVICES='3'"):
        local_device("cuda")


@pytest.mark.gpu
def test_a_process_placed_on_a_gpu_computes_on_the_first_it_sees():
    assert local_device("cuda") == torch.device("cuda", 0) and torch.cuda.current_device() == 0
