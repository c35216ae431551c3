"""The engine's own forward over the paged cache (generation/engine/decode.py, paged_batch.py) against the
transformers forward it replaces."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from generation_helpers import VOCAB_SIZE, before_every_forward, greedy_reference, save_model_dir, tiny_config
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2ForCausalLM

from areal_flow.generation.engine.decode import DecodeStep
from areal_flow.generation.engine.generation_engine import GenerationEngine, GenerationRequest, SamplingParams
from areal_flow.generation.engine.kv_batch import Row
from areal_flow.generation.engine.paged import BlockPool
from areal_flow.generation.engine.paged_batch import PagedBatch

SMALL = dict(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             max_position_embeddings=128, eos_token_id=1, pad_token_id=0)


def qwen2_gqa() -> torch.nn.Module:  # q/k/v biases, 2 query heads per KV head
    return Qwen2ForCausalLM(tiny_config(hidden_size=32, intermediate_size=64))


def llama_mha_tied() -> torch.nn.Module:  # no biases, one KV head per query head, tied output layer
    return LlamaForCausalLM(LlamaConfig(**SMALL, num_attention_heads=4, num_key_value_heads=4,
                                        tie_word_embeddings=True))


def llama3_biased() -> torch.nn.Module:  # Llama 3 rope scaling, attention and MLP biases, one KV head
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    return LlamaForCausalLM(LlamaConfig(**SMALL, num_attention_heads=4, num_key_value_heads=1,
                                        attention_bias=True, mlp_bias=True, rope_parameters=rope))


def rows(*prompts: tuple[int, ...]) -> list[Row]:
    return [Row(GenerationRequest(p, SamplingParams()), Future(), frozenset()) for p in prompts]


def reference_logits(model: torch.nn.Module, sequence: tuple[int, ...]) -> torch.Tensor:
    return model(input_ids=torch.tensor([sequence])).logits[0, -1]


def paged(step: DecodeStep, page_size: int, chunk: int | None) -> PagedBatch:
    pool = BlockPool(layers=len(step.layers), kv_heads=step.kv_heads, head_dim=step.head_dim, block_size=page_size,
                     num_blocks=None, dtype=torch.float32, device=torch.device("cpu"))
    return PagedBatch(pool, step, chunk)


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["batched", "batch-invariant"])
@pytest.mark.parametrize("build", [qwen2_gqa, llama_mha_tied, llama3_biased])
@pytest.mark.parametrize("page_size, chunk", [(3, 4), (16, None)])
@torch.inference_mode()
def test_paged_forwards_give_the_logits_of_the_transformers_forward(build, batch_invariant, page_size, chunk):
    """Rows of different prompt lengths prefilled in chunks mixed with decode rows, two answers of
    one prompt forking its blocks, a row joining later: every row's logits at every step are those
    of the transformers forward over its whole sequence, and the cache holds its keys."""
    torch.manual_seed(0)
    model = build().eval()
    reference = build().eval()
    reference.load_state_dict(model.state_dict())  # an untouched copy: DecodeStep re-plumbs `model`
    step = DecodeStep.for_model(model, batch_invariant=batch_invariant)
    assert step is not None
    batch = paged(step, page_size, chunk)
    prompts = [tuple(torch.randint(2, VOCAB_SIZE, (n,)).tolist()) for n in (9, 2, 5)]
    first, other, twin = rows(prompts[0], prompts[1], prompts[0])
    batch.add([first, other, twin])  # the twin follows the first
    late = rows(prompts[2])
    for i in range(8):
        if i == 3:
            batch.add(late)
        for row, logits in zip(batch.ready, batch.logits if batch.ready else ()):
            row.output_ids.append(int(logits.argmax()))
        batch.make_room()
        batch.forward({})
        for row, logits in zip(batch.ready, batch.logits):
            torch.testing.assert_close(logits, reference_logits(reference, row.sequence), atol=1e-5, rtol=0)
    assert len(batch.ready) == 4 and not batch.pending
    assert first.output_ids == twin.output_ids  # greedy: the fork answers as its leader
    shared = first.blocks[: len(prompts[0]) // page_size]
    assert shared == twin.blocks[: len(shared)] and first.blocks[len(shared)] != twin.blocks[len(shared)]
    theirs = reference(input_ids=torch.tensor([first.sequence]), use_cache=True).past_key_values
    slots = torch.tensor([first.blocks[p // page_size] * page_size + p % page_size for p in range(first.computed)])
    for i, layer in enumerate(theirs.layers):  # the keys it wrote are the ones transformers computes
        torch.testing.assert_close(batch.pool.k[i][:, slots], layer.keys[0], atol=1e-5, rtol=0)


@torch.inference_mode()
def test_a_weight_update_written_into_the_parameters_reaches_the_fused_projections():
    torch.manual_seed(0)
    model, other = qwen2_gqa().eval(), qwen2_gqa().eval()
    step = DecodeStep.for_model(model)
    params = model.state_dict()
    for name, tensor in other.state_dict().items():  # as the engine loads new weights: in place
        params[name].copy_(tensor)
    batch = paged(step, 4, None)
    batch.add(rows((2, 5, 7, 3, 9)))
    batch.forward({})
    torch.testing.assert_close(batch.logits[0], reference_logits(other, (2, 5, 7, 3, 9)), atol=1e-5, rtol=0)


@pytest.mark.parametrize("config, why", [
    (MistralConfig(**SMALL, num_attention_heads=4, num_key_value_heads=2), "another architecture"),
    (LlamaConfig(**SMALL, num_attention_heads=4, num_key_value_heads=2, hidden_act="gelu"), "another activation"),
    (LlamaConfig(**SMALL, num_attention_heads=4, num_key_value_heads=2,
                 rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
     "rope that depends on the sequence length"),
])
def test_models_whose_decode_it_does_not_reproduce_are_left_to_transformers(config, why):
    from transformers import AutoModelForCausalLM

    assert DecodeStep.for_model(AutoModelForCausalLM.from_config(config)) is None, why


def test_the_engine_decodes_an_unsupported_architecture_through_transformers(tmp_path):
    torch.manual_seed(3)
    model = MistralForCausalLM(MistralConfig(**SMALL, num_attention_heads=4, num_key_value_heads=2)).eval()
    path = save_model_dir(model, tmp_path / "mistral")
    engine = GenerationEngine(path, max_batch_size=4)  # the default fast_decode=True, refused by the model
    forwards: list[tuple[int, ...]] = []
    before_every_forward(engine, lambda module, args: forwards.append(tuple(args[0].shape)))
    try:
        prompts = [(2, 5, 7), (3, 4, 5, 6, 9)]
        # Queued together (one after the other, the first could end before the second came: CI saw it).
        params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
        results = [f.result(timeout=60) for f in engine.submit_many([GenerationRequest(p, params) for p in prompts])]
    finally:
        engine.shutdown()
    assert engine.page_size is None  # the dense backend: the transformers forward over a left-padded cache
    assert [r.output_ids for r in results] == [greedy_reference(model, list(p), 8, stop_ids=()) for p in prompts]
    assert (2, 1) in forwards  # decode steps ran, through the model's forward


KERNEL_CHECK = """
import sys, torch
sys.path.insert(0, {tests!r})
from test_decode_step import qwen2_gqa, reference_logits, rows, paged
from areal_flow.generation.engine.decode import DecodeStep
torch.manual_seed(0)
model, reference = qwen2_gqa().eval(), qwen2_gqa().eval()
reference.load_state_dict(model.state_dict())
step = DecodeStep.for_model(model)
step.paged_kernel = True  # the GPU's decode attention, here through Triton's interpreter
batch = paged(step, 3, 4)
batch.add(rows((2, 5, 7, 3, 9, 4, 4), (6, 2), (2, 5, 7, 3, 9, 4, 4)))
with torch.inference_mode():
    for _ in range(6):
        for row, logits in zip(batch.ready, batch.logits if batch.ready else ()):
            row.output_ids.append(int(logits.argmax()))
        batch.make_room()
        batch.forward({{}})
        for row, logits in zip(batch.ready, batch.logits):
            torch.testing.assert_close(logits, reference_logits(reference, row.sequence), atol=1e-5, rtol=0)
print("ok", len(batch.ready))
"""


@pytest.mark.slow  # Triton's interpreter takes ~10 s
def test_the_triton_decode_kernel_in_the_paged_forward_gives_the_transformers_logits():
    """The forward with its decode attention through the Triton kernel (the CUDA path), run by Triton's
    interpreter on the CPU: the block tables and lengths it is handed give every row its logits."""
    pytest.importorskip("triton")
    tests = str(Path(__file__).resolve().parent)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", KERNEL_CHECK.format(tests=tests)], env=env, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0 and "ok 3" in done.stdout, done.stderr[-3000:]
