"""The engine's own decode step (generation/decode.py) against the transformers forward it replaces."""

from __future__ import annotations

import pytest
import torch
from generation_helpers import VOCAB_SIZE, before_every_forward, greedy_reference, save_model_dir, tiny_config
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2ForCausalLM
from transformers.cache_utils import Cache

from areal_flow.generation.decode import DecodeStep, padding_bias
from areal_flow.generation.engine import GenerationEngine
from areal_flow.generation.kv_batch import GrowingLayer

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


def prefill(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> tuple[Cache, torch.Tensor]:
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                past_key_values=Cache(layer_class_to_replicate=GrowingLayer), use_cache=True)
    return out.past_key_values, out.logits[:, -1]


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["batched", "batch-invariant"])
@pytest.mark.parametrize("build", [qwen2_gqa, llama_mha_tied, llama3_biased])
@torch.inference_mode()
def test_decode_steps_give_the_logits_of_the_transformers_forward(build, batch_invariant):
    torch.manual_seed(0)
    model = build().eval()
    reference = build().eval()
    reference.load_state_dict(model.state_dict())  # an untouched copy: DecodeStep re-plumbs `model`
    step = DecodeStep.for_model(model, batch_invariant=batch_invariant)
    assert step is not None
    # Left-padded rows of different prompt lengths; row 2 stops advancing after two steps, as a
    # finished row that decodes along until the batch is compacted.
    ids = torch.randint(2, VOCAB_SIZE, (3, 9))
    mask = torch.ones(3, 9, dtype=torch.int64)
    mask[0, :4] = mask[2, :7] = 0
    ours, _ = prefill(model, ids, mask)
    theirs, logits = prefill(reference, ids, mask)
    positions = mask.sum(dim=1) - 1
    for i in range(6):
        tokens = logits.argmax(dim=-1)
        mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.int64)], dim=1)
        positions = positions + torch.tensor([1, 1, int(i < 2)])
        logits = reference(input_ids=tokens[:, None], attention_mask=mask, position_ids=positions[:, None],
                           past_key_values=theirs, use_cache=True).logits[:, -1]
        got = step(tokens, positions, ours, padding_bias(mask, torch.float32))
        torch.testing.assert_close(got, logits, atol=1e-5, rtol=0)
        for a, b in zip(ours.layers, theirs.layers):  # the cache it writes is the one transformers writes
            torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=0)


@torch.inference_mode()
def test_a_weight_update_written_into_the_parameters_reaches_the_fused_projections():
    torch.manual_seed(0)
    model, other = qwen2_gqa().eval(), qwen2_gqa().eval()
    step = DecodeStep.for_model(model)
    params = model.state_dict()
    for name, tensor in other.state_dict().items():  # as the engine loads new weights: in place
        params[name].copy_(tensor)
    ids, mask = torch.randint(2, VOCAB_SIZE, (2, 5)), torch.ones(2, 5, dtype=torch.int64)
    cache, logits = prefill(model, ids, mask)
    other_cache, _ = prefill(other, ids, mask)
    tokens, positions = logits.argmax(dim=-1), torch.tensor([5, 5])
    mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.int64)], dim=1)
    expected = other(input_ids=tokens[:, None], attention_mask=mask, position_ids=positions[:, None],
                     past_key_values=other_cache, use_cache=True).logits[:, -1]
    torch.testing.assert_close(step(tokens, positions, cache, padding_bias(mask, torch.float32)), expected,
                               atol=1e-5, rtol=0)


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
        results = [f.result(timeout=60) for f in [engine.submit(p, max_new_tokens=8, temperature=0.0,
                                                                ignore_eos=True) for p in prompts]]
    finally:
        engine.shutdown()
    assert engine._decode_step is None
    assert [r.output_ids for r in results] == [greedy_reference(model, list(p), 8, stop_ids=()) for p in prompts]
    assert (2, 1) in forwards  # decode steps ran, through the model's forward
