"""Decode steps padded to CUDA-graph buckets (generation/engine/cuda_graphs.py): on the CPU the padding
runs eagerly (`capture=False`) and must change no row's logits nor any row's cache; on a GPU the
captured graphs must give the eager logits."""

from __future__ import annotations

import random
from concurrent.futures import Future

import pytest
import torch
from generation_helpers import VOCAB_SIZE, ModelDirs, full_forward_logprobs, load_reference, tiny_config
from transformers import Qwen2ForCausalLM

from areal_flow.generation.engine.cuda_graphs import GraphRunner, _width_bucket
from areal_flow.generation.engine.decode import DecodeStep
from areal_flow.generation.engine.generation_engine import GenerationEngine, GenerationRequest, SamplingParams
from areal_flow.generation.engine.kv_batch import Row
from areal_flow.generation.engine.paged import BlockPool
from areal_flow.generation.engine.paged_batch import PagedBatch


def test_widths_round_up_by_at_most_a_quarter():
    for blocks in range(1, 300):
        bucket = _width_bucket(blocks * 16, 16) // 16
        assert blocks <= bucket <= max(blocks, 1.25 * (blocks - 1) + 1)
    assert _width_bucket(1, 16) == 16 and _width_bucket(17, 16) == 32


def greedy_step(batch: PagedBatch, reference: torch.nn.Module, device: str) -> None:
    """Each ready row takes its argmax token, then one forward: every row's logits must be the
    reference model's over its whole sequence."""
    for row, logits in zip(batch.ready, batch.logits if batch.ready else ()):
        row.output_ids.append(int(logits.argmax()))
    batch.make_room()
    batch.forward({})
    for row, logits in zip(batch.ready, batch.logits):
        expected = reference(input_ids=torch.tensor([row.sequence], device=device)).logits[0, -1]
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@torch.inference_mode()
def test_padded_decode_steps_give_every_row_its_own_logits(device):
    """Rows join and finish, so steps move between row buckets (8 → 4 → 8 rows) and widths: each
    row's logits equal the transformers forward over its sequence, though padded rows write into
    the null block and padded columns read it."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(tiny_config(hidden_size=32, intermediate_size=64)).eval().to(device)
    reference = Qwen2ForCausalLM(tiny_config(hidden_size=32, intermediate_size=64)).eval().to(device)
    reference.load_state_dict(model.state_dict())
    step = DecodeStep.for_model(model)
    pool = BlockPool(layers=len(step.layers), kv_heads=step.kv_heads, head_dim=step.head_dim, block_size=4,
                     num_blocks=64, dtype=torch.float32, device=torch.device(device))
    runner = GraphRunner(step, max_rows=8, capture=device == "cuda")
    batch = PagedBatch(pool, step, None, runner)
    rng = random.Random(0)

    def rows(n: int) -> list[Row]:
        prompts = [tuple(rng.randrange(2, VOCAB_SIZE) for _ in range(rng.randint(1, 9))) for _ in range(n)]
        return [Row(GenerationRequest(p, SamplingParams()), Future(), frozenset()) for p in prompts]

    batch.add(rows(7))
    for i in range(12):
        if i == 4:  # four rows finish: the next steps pad 3 rows to 4
            for row in batch.ready[:4]:
                row.finish = ("stop", None)
            batch.drop_finished()
        if i == 8:
            batch.add(rows(3))
        greedy_step(batch, reference, device)
    assert runner.bucketed >= 9  # the steps without a prefill
    assert runner.replays > 0 if device == "cuda" else runner.replays == 0
    assert len(batch.ready) == 6


@pytest.mark.gpu
def test_the_engine_on_cuda_replays_graphs_and_its_logprobs_are_exact(model_dirs: ModelDirs):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    engine = GenerationEngine(model_dirs.a, max_batch_size=16, device="cuda", dtype=torch.float32)
    reference = load_reference(model_dirs.a)
    try:
        prompts = [[2 + (i * 7 + j) % 15 for j in range(1 + i % 6)] for i in range(12)]
        futures = [engine.submit(p, max_new_tokens=20, temperature=1.0, ignore_eos=True) for p in prompts]
        results = [f.result(timeout=120) for f in futures]
        replays = engine.cuda_graphs.replays
        engine.release_memory()  # the cache is freed and taken again: the graphs are captured anew over it
        engine.continue_generation()
        futures = [engine.submit(p, max_new_tokens=20, temperature=1.0, ignore_eos=True) for p in prompts]
        results += [f.result(timeout=120) for f in futures]
        prompts += prompts
    finally:
        engine.shutdown()
    assert engine.cuda_graphs is not None and 0 < replays < engine.cuda_graphs.replays
    for prompt, result in zip(prompts, results):
        expected = full_forward_logprobs(reference, prompt, result.output_ids, 1.0)
        torch.testing.assert_close(torch.tensor(result.output_logprobs), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@torch.inference_mode()
def test_lora_paths_of_new_shapes_drop_the_buckets_and_same_shaped_ones_are_copied_in(device):
    """generation.lora_decode=lowrank: installing paths of new shapes drops the captured buckets (a
    graph reads the tensors it was captured with); an update of the same shapes is copied into them
    (generation/engine/adapters.py `Install`), so the buckets stay. Either way each row's logits are
    those of the weights merged (W + scale·B·A)."""
    from areal_flow.generation.engine import lowrank
    from areal_flow.generation.engine.adapters import Install

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(tiny_config(hidden_size=32, intermediate_size=64)).eval().to(device)
    merged = Qwen2ForCausalLM(tiny_config(hidden_size=32, intermediate_size=64)).eval().to(device)
    step = DecodeStep.for_model(model)
    pool = BlockPool(layers=len(step.layers), kv_heads=step.kv_heads, head_dim=step.head_dim, block_size=4,
                     num_blocks=64, dtype=torch.float32, device=torch.device(device))
    runner = GraphRunner(step, max_rows=8, capture=device == "cuda")
    rng = random.Random(0)
    names = ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")

    def adapters(scale: float) -> dict:
        return {f"model.layers.{i}.{n}": (torch.randn(4, lin.in_features) * scale, torch.randn(lin.out_features, 4) * scale)
                for i, layer in enumerate(step.layers) for n in names if (lin := layer.get_submodule(n))}

    def install(modules: dict) -> None:
        Install(lowrank.build(step.layers, modules, 2.0, device=torch.device(device), dtype=torch.float32,
                              where="test"), step, "digest")(model)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        for module, (a, b) in modules.items():
            state[f"{module}.weight"] += 2.0 * (b @ a).to(device)
        merged.load_state_dict(state)

    def steps(n: int) -> None:
        """n decode steps of 5 new rows (the cache holds the keys of the weights they start on)."""
        batch = PagedBatch(pool, step, None, runner)
        prompts = [tuple(rng.randrange(2, VOCAB_SIZE) for _ in range(rng.randint(1, 9))) for _ in range(5)]
        batch.add([Row(GenerationRequest(p, SamplingParams()), Future(), frozenset()) for p in prompts])
        for _ in range(n):
            greedy_step(batch, merged, device)
        for row in batch.ready:
            row.finish = ("stop", None)
        batch.drop_finished()

    merged.load_state_dict(model.state_dict())
    steps(3)
    assert runner._static
    install(adapters(0.1))  # new shapes: the buckets go
    steps(3)
    first = step.lowrank
    assert len(runner._static) == 1 and runner._lowrank is first
    install(adapters(0.1))  # the same shapes: copied in, the buckets stay
    assert step.lowrank is first
    kept = dict(runner._static)
    steps(3)
    assert all(runner._static[k] is v for k, v in kept.items())
