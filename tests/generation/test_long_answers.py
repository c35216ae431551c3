"""Long answers through the paged cache (the paper generates up to 27k tokens): two seeded requests
of 16,384 tokens each on a GPU (2,048 on the CPU) in a KV budget that holds one and a half of them,
so one is preempted (retracted, prefilled again with its tokens so far) and goes on. Each answer is
whole, and every logprob is the one a `transformers` forward over the prompt and answer gives: the
block tables, the positions past 8k, the decode kernel over 1,000 blocks and the graphs' widest
buckets all agree with the reference. tools/bench_long.py measures the same at the 1.5B shape."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

from areal_flow.generation.engine.generation_engine import GenerationEngine

PROMPT = 64


def reference_logprobs(model: Qwen2ForCausalLM, tokens: list[int], prompt: int, chunk: int = 1024) -> torch.Tensor:
    """log_softmax of the model's logits over `tokens` (temperature 1) at each answer token, by
    chunks over a cache (a 16k-square attention at once would take gigabytes)."""
    ids = torch.tensor([tokens], device=model.device)
    cache, out = DynamicCache(), []
    with torch.inference_mode():
        for start in range(0, len(tokens), chunk):
            logits = model(input_ids=ids[:, start: start + chunk], past_key_values=cache, use_cache=True).logits[0]
            out.append(torch.log_softmax(logits.float(), dim=-1))
    logprobs = torch.cat(out)[prompt - 1: -1]  # position p predicts token p + 1
    return logprobs.gather(1, ids[0, prompt:, None]).squeeze(1).cpu()


@pytest.mark.parametrize("device,new_tokens", [pytest.param("cpu", 2048, marks=pytest.mark.slow),
                                               pytest.param("cuda", 16384, marks=pytest.mark.gpu)])
def test_long_answers_are_whole_with_the_reference_logprobs_through_a_preemption(tmp_path, device, new_tokens):
    context = PROMPT + new_tokens
    torch.manual_seed(0)
    # Weights ten times the default scale: peaked distributions, whose logprobs tell positions apart.
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
                         tie_word_embeddings=False, eos_token_id=1, initializer_range=0.2)
    Qwen2ForCausalLM(config).save_pretrained(tmp_path / "model")
    engine = GenerationEngine(str(tmp_path / "model"), max_batch_size=2, device=device, dtype=torch.float32,
                              num_threads=2, max_total_tokens=3 * context // 2)
    try:
        prompts = [[(7 * i + 3 * r) % 62 + 2 for i in range(PROMPT)] for r in range(2)]
        futures = [engine.submit(p, max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True, seed=10 + r)
                   for r, p in enumerate(prompts)]
        results = [f.result(timeout=1500) for f in futures]
    finally:
        engine.shutdown()
    assert [len(r.output_ids) for r in results] == [new_tokens] * 2
    assert sum(r.retractions for r in results) >= 1  # one waited for the other's blocks
    model = Qwen2ForCausalLM.from_pretrained(str(tmp_path / "model"), dtype=torch.float32).to(device).eval()
    for prompt, r in zip(prompts, results):
        expected = reference_logprobs(model, prompt + r.output_ids, PROMPT)
        got = torch.tensor(r.output_logprobs)
        assert (got - expected).abs().max().item() < 1e-3
