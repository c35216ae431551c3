"""The engine's device and number format: bfloat16 weights and KV cache with float32 logprobs, the
KV budget from a share of the device's memory, and the same engine on CUDA (gpu-marked)."""

from __future__ import annotations

import pytest
import torch
from generation_helpers import ModelDirs, full_forward_logprobs, load_reference
from transformers import AutoConfig

from areal_flow.generation.engine.generation_engine import GenerationEngine
from areal_flow.generation.engine.kv_budget import kv_budget_tokens, kv_bytes_per_token


def test_kv_bytes_per_token_count_keys_and_values_of_every_kv_head_in_every_layer():
    config = AutoConfig.for_model("qwen2", hidden_size=896, num_attention_heads=14, num_key_value_heads=2,
                                  num_hidden_layers=24)
    # Qwen2-0.5B: 24 layers × (K + V) × 2 KV heads × 64 dims × 2 bytes = 12 KiB a token in bf16.
    assert kv_bytes_per_token(config, torch.bfloat16) == 24 * 2 * 2 * 64 * 2 == 12288
    assert kv_bytes_per_token(config, torch.float32) == 2 * 12288


def test_the_kv_budget_is_what_the_share_leaves_beside_the_weights_and_none_left_is_an_error():
    gib = 2**30
    # SGLang's rule: 0.5 of 80 GiB is 40 GiB, of which 1 GiB holds the weights.
    assert kv_budget_tokens(0.5, 80 * gib, 1 * gib, 12288) == 39 * gib // 12288
    with pytest.raises(ValueError, match=r"generation.mem_fraction_static=0.1 of 80.0 GiB leaves no room .*"
                                         r"the server's weights take 9.0 GiB of it"):
        kv_budget_tokens(0.1, 80 * gib, 9 * gib, 12288)


def test_a_bfloat16_engine_keeps_its_weights_in_bfloat16_and_reports_float32_logprobs_near_the_reference(
        model_dirs: ModelDirs):
    engine = GenerationEngine(model_dirs.a, max_batch_size=4, dtype=torch.bfloat16)
    reference = load_reference(model_dirs.a)
    try:
        assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
        prompt = [3, 5, 7, 11]
        result = engine.submit(prompt, max_new_tokens=12, temperature=1.0, ignore_eos=True).result(timeout=60)
        assert all(isinstance(lp, float) for lp in result.output_logprobs)
        expected = full_forward_logprobs(reference, prompt, result.output_ids, 1.0)
        # bfloat16 keeps about 3 significant digits of every activation.
        torch.testing.assert_close(torch.tensor(result.output_logprobs), expected, atol=0.1, rtol=0)
    finally:
        engine.shutdown()


@pytest.mark.gpu
def test_the_engine_on_cuda_in_float32_agrees_with_the_cpu_reference(model_dirs: ModelDirs):
    torch.backends.cuda.matmul.allow_tf32 = False
    engine = GenerationEngine(model_dirs.a, max_batch_size=8, device="cuda")
    reference = load_reference(model_dirs.a)
    try:
        assert engine.model.lm_head.weight.device.type == "cuda"
        prompts = [[3, 5, 7], [2, 4, 6, 8, 10], [9]]
        futures = [engine.submit(p, max_new_tokens=16, temperature=0.8, top_p=0.9, ignore_eos=True, seed=i)
                   for i, p in enumerate(prompts)]
        for prompt, future in zip(prompts, futures):
            result = future.result(timeout=60)
            expected = full_forward_logprobs(reference, prompt, result.output_ids, 0.8)
            torch.testing.assert_close(torch.tensor(result.output_logprobs), expected, atol=1e-4, rtol=0)
    finally:
        engine.shutdown()


@pytest.mark.gpu
def test_the_engine_on_cuda_sizes_its_kv_budget_from_the_memory_share(model_dirs: ModelDirs):
    engine = GenerationEngine(model_dirs.a, max_batch_size=8, device="cuda", dtype=torch.bfloat16, mem_fraction=0.05)
    try:
        total = torch.cuda.get_device_properties(0).total_memory
        per_token = kv_bytes_per_token(engine.model.config, torch.bfloat16)
        assert 0 < engine.max_total_tokens <= 0.05 * total / per_token
    finally:
        engine.shutdown()
