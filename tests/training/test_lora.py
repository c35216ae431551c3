"""LoRA on the torch engine (training.lora, training/lora.py): only the adapters train; the weights that
leave the trainer are the base with the adapters merged in fp32; a checkpoint holds a PEFT adapter
directory that peft loads; a resumable checkpoint resumes exactly; a target that matches nothing is
named by key."""

import os
from functools import partial

import numpy as np
import pytest
import torch
from engine_helpers import make_seqs, make_token_data, save_tiny_qwen2
from transformers import AutoModelForCausalLM

from areal_flow.algorithms.library import objective
from areal_flow.config.schema import AlgorithmConfig
from areal_flow.training.engine import CheckpointError, OptimSpec
from areal_flow.training.lora import LoraSpec
from areal_flow.training.torch_checkpoint import LORA_DIR
from areal_flow.training.torch_engine import TorchEngine

SPEC = LoraSpec(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"), init="gaussian")
LOSS = partial(objective, algo=AlgorithmConfig(), prox_source="data", prox_version=0, kl_coef=0.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"))


def step(engine: TorchEngine, seed: int) -> dict:
    seqs = [(p, o if len(o) else np.array([1])) for p, o in make_seqs(seed, 8)]
    return engine.train_step(seqs, make_token_data(seqs, seed), LOSS)


def lora_engine(model_dir: str, spec: LoraSpec = SPEC) -> TorchEngine:
    torch.manual_seed(0)  # the adapters' initialisation, as a trainer seeds before building its engines
    return TorchEngine(model_dir, optim=OptimSpec(lr=1e-2), micro_batch_tokens=256, lora=spec)


def test_only_the_adapters_train_and_the_optimizer_holds_them_alone(model_dir):
    engine = lora_engine(model_dir)
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    step(engine, 1)
    changed = {n for n, p in engine.model.named_parameters() if not torch.equal(p, before[n])}
    adapters = {n for n in before if ".lora_" in n}
    assert changed and changed <= adapters  # B starts at 0 under "default" init; both move under gaussian
    held = {id(p) for g in engine._optimizer.param_groups for p in g["params"]}
    assert held == {id(p) for n, p in engine.model.named_parameters() if n in adapters}
    assert len(adapters) == 2 * 3 * 2  # A and B of 3 targets in 2 layers


def test_the_exported_weights_are_the_merged_model_and_its_logprobs_match(model_dir, tmp_path):
    engine = lora_engine(model_dir)
    step(engine, 2)
    exported = dict(kv for bucket in engine.export_weights(1 << 20) for kv in bucket)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert set(exported) == {n for n, _ in base.named_parameters()}  # no adapter or base_layer names
    engine.save_weights(str(tmp_path / "v1"))
    served = AutoModelForCausalLM.from_pretrained(str(tmp_path / "v1"), dtype=torch.float32).eval()
    for name, p in served.named_parameters():
        assert torch.equal(p, exported[name]), name
    seqs = [(p, o if len(o) else np.array([1])) for p, o in make_seqs(5, 4)]
    with torch.no_grad():
        for (prompt, out), lp in zip(seqs, engine.logprobs(seqs)):
            ids = torch.tensor(np.concatenate([prompt, out]))[None]
            ref = torch.log_softmax(served(ids).logits[0, len(prompt) - 1:-1].float(), -1)
            np.testing.assert_allclose(lp, ref.gather(1, torch.tensor(out)[:, None])[:, 0].numpy(), atol=2e-5)


def test_a_saved_checkpoint_holds_a_peft_adapter_directory_that_peft_loads(model_dir, tmp_path):
    from peft import PeftModel

    engine = lora_engine(model_dir)
    step(engine, 3)
    engine.save(str(tmp_path / "final"))
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "final"), dtype=torch.float32).eval()
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                        str(tmp_path / "final" / LORA_DIR)).eval()
    ids = torch.tensor([[2, 5, 7, 3, 9, 11, 4]])
    with torch.no_grad():
        torch.testing.assert_close(adapted(ids).logits, merged(ids).logits, atol=1e-5, rtol=0)
        # peft's own merge agrees with the engine's fp32 merge
        own = adapted.merge_and_unload()
        for name, p in own.named_parameters():
            torch.testing.assert_close(p, dict(merged.named_parameters())[name], atol=1e-6, rtol=0)
    with pytest.raises(CheckpointError, match="loads resumable checkpoints only"):
        lora_engine(model_dir).load(str(tmp_path / "final"))


def test_a_resumable_checkpoint_resumes_bit_for_bit(model_dir, tmp_path):
    whole_run = lora_engine(model_dir)
    for seed in (1, 2, 3):
        step(whole_run, seed)
    first = lora_engine(model_dir)
    step(first, 1)
    first.save_resumable(str(tmp_path / "ckpt"))
    assert os.path.isfile(tmp_path / "ckpt" / LORA_DIR / "adapter_config.json")
    resumed = lora_engine(model_dir)
    resumed.load_resumable(str(tmp_path / "ckpt"))
    for seed in (2, 3):
        step(resumed, seed)
    assert resumed.weights_digest() == whole_run.weights_digest()


def test_a_target_that_matches_no_layer_is_named_by_key(model_dir):
    with pytest.raises(ValueError, match=r"training.lora.target_modules=\['qkv'\]"):
        lora_engine(model_dir, LoraSpec(rank=2, alpha=4.0, target_modules=("qkv",)))
    with pytest.raises(ValueError, match="training.lora.target_regex"):
        lora_engine(model_dir, LoraSpec(rank=2, alpha=4.0, target_regex=r".*nothing_here"))


def test_dropout_applies_in_the_train_step_only(model_dir):
    engine = lora_engine(model_dir, LoraSpec(rank=4, alpha=8.0, dropout=0.5, target_modules=("q_proj",), init="gaussian"))
    seqs = [(p, o if len(o) else np.array([1])) for p, o in make_seqs(7, 4)]
    a, b = engine.logprobs(seqs), engine.logprobs(seqs)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))  # deterministic outside the train step
    assert len(engine._lora_dropouts) == 2 and not any(d.training for d in engine._lora_dropouts)
