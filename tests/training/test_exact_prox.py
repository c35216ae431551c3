"""training.zero_mismatch's π_prox (training/exact_prox.py): from a real trainer engine's weights, after
a train step, the logprobs a batch-invariant server reports for answers it sampled on the published
weights, bit for bit; tied embeddings; the trainer's RNG untouched; bad weights named."""

from functools import partial

import numpy as np
import pytest
import torch
from engine_helpers import make_seqs, make_token_data, save_tiny_qwen2

from areal_flow.algorithms.library import objective
from areal_flow.config.schema import AlgorithmConfig
from areal_flow.generation.engine.generation_engine import GenerationEngine
from areal_flow.training.engine import OptimSpec
from areal_flow.training.exact_prox import ExactProx, ZeroMismatchError, torch_threads
from areal_flow.training.torch_engine import TorchEngine


def trained_engine(model_dir: str) -> TorchEngine:
    """A trainer engine one optimizer step past the base model, at version 1."""
    engine = TorchEngine(model_dir, optim=OptimSpec(lr=1e-2), micro_batch_tokens=256)
    seqs = [(p, o if len(o) else np.array([1])) for p, o in make_seqs(3, 8)]
    loss = partial(objective, algo=AlgorithmConfig(), prox_source="data", prox_version=0, kl_coef=0.0)
    engine.train_step(seqs, make_token_data(seqs, 3), loss)
    engine.version = 1
    return engine


def served(weights_dir: str, prompts: list[list[int]]):
    """Seeded answers and their logprobs from a batch-invariant engine on `weights_dir`, one thread."""
    engine = GenerationEngine(weights_dir, max_batch_size=16, batch_invariant=True, num_threads=1)
    try:
        futures = [engine.submit(p, seed=40 + i, max_new_tokens=16, temperature=1.0, ignore_eos=True)
                   for i, p in enumerate(prompts)]
        return [(f.result(timeout=60).output_ids, f.result().output_logprobs) for f in futures]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("tied", [False, True])
def test_prox_from_the_trainers_weights_equals_the_servers_logprobs_bit_for_bit(tmp_path, tied):
    model_dir = save_tiny_qwen2(tmp_path / "base", tie_word_embeddings=tied)
    with torch_threads(1):
        engine = trained_engine(model_dir)
        engine.save_weights(str(tmp_path / "v1"))  # what the servers load as version 1
        prompts = [[2, 7, 3, 9], [5, 6], [3, 4, 5, 6, 7, 8, 9, 10, 11], [12]]
        answers = served(str(tmp_path / "v1"), prompts)
        exact = ExactProx(model_dir, device=torch.device("cpu"), dtype=torch.float32, threads=1, block_size=16,
                          temperature=1.0)
        rng = torch.get_rng_state()
        exact.load(engine)
        assert torch.equal(torch.get_rng_state(), rng)
        got = exact.logprobs([np.array(p) for p in prompts], [np.array(t) for t, _ in answers],
                             [np.ones(len(t), np.int64) for t, _ in answers])
        trainer = engine.logprobs([(np.array(p), np.array(t)) for p, (t, _) in zip(prompts, answers)])
    for (_, behav), lp, own in zip(answers, got, trainer):
        assert np.array_equal(lp, np.float32(behav))
        np.testing.assert_allclose(own, behav, atol=1e-4)  # the trainer's own forward: close, not exact
    assert exact.version == 1


def test_the_copy_takes_new_weights_once_per_version(tmp_path):
    model_dir = save_tiny_qwen2(tmp_path / "base")
    engine = TorchEngine(model_dir, optim=OptimSpec(lr=1e-2), micro_batch_tokens=256)
    exact = ExactProx(model_dir, device=torch.device("cpu"), dtype=torch.float32, threads=None, block_size=16,
                      temperature=1.0)
    args = ([np.array([2, 3, 4])], [np.array([5, 6, 7])], [np.zeros(3, np.int64)])
    exact.load(engine)
    before = exact.logprobs(*args)[0]
    with torch.no_grad():
        for p in engine._model.parameters():
            p.add_(0.05)
    exact.load(engine)  # the same version: the copy keeps what it has
    assert np.array_equal(exact.logprobs(*args)[0], before)
    engine.version = 1
    exact.load(engine)
    assert not np.array_equal(exact.logprobs(*args)[0], before)


class Exported:
    """An engine's `export_weights` and version, as a test sets them."""

    def __init__(self, named, version=1):
        self.named, self.version = named, version

    def export_weights(self, bucket_bytes):
        yield self.named


def test_weights_the_servers_model_does_not_have_are_named(tmp_path):
    model_dir = save_tiny_qwen2(tmp_path / "base")
    exact = ExactProx(model_dir, device=torch.device("cpu"), dtype=torch.float32, threads=None, block_size=16,
                      temperature=1.0)
    named = [(n, p.detach().clone()) for n, p in TorchEngine(model_dir, optim=None)._model.named_parameters()]
    with pytest.raises(ZeroMismatchError, match="exports 'model.extra.weight'"):
        exact.load(Exported([*named, ("model.extra.weight", torch.zeros(2))]))
    with pytest.raises(ZeroMismatchError, match=r"model.norm.weight has shape \(3,\)"):
        exact.load(Exported([(n, torch.zeros(3) if n == "model.norm.weight" else t) for n, t in named]))
    with pytest.raises(ZeroMismatchError, match="exports no lm_head.weight"):
        exact.load(Exported([(n, t) for n, t in named if n != "lm_head.weight"]))
    assert exact.version is None  # nothing half-loaded counts as a version


@pytest.mark.parametrize("lora_decode", ["lowrank", "merge"])
def test_with_lora_the_copy_applies_the_adapters_as_the_servers_do(tmp_path, lora_decode):
    """training.lora: the copy holds the base and takes each version's adapters alone, applied as the
    servers apply them (generation.lora_decode): bit for bit a server started from the adapters."""
    from areal_flow.training.lora import LoraSpec

    model_dir = save_tiny_qwen2(tmp_path / "base")
    with torch_threads(1):
        torch.manual_seed(0)
        engine = TorchEngine(model_dir, optim=OptimSpec(lr=1e-2), micro_batch_tokens=256,
                             lora=LoraSpec(rank=4, alpha=8.0, init="gaussian"))
        seqs = [(p, o if len(o) else np.array([1])) for p, o in make_seqs(3, 8)]
        engine.train_step(seqs, make_token_data(seqs, 3), partial(objective, algo=AlgorithmConfig(),
                                                                  prox_source="data", prox_version=0, kl_coef=0.0))
        engine.version = 1
        engine.save_update(str(tmp_path / "v1"))
        prompts = [[2, 7, 3, 9], [5, 6], [3, 4, 5, 6, 7, 8, 9, 10, 11]]
        server = GenerationEngine(str(tmp_path / "v1"), max_batch_size=16, batch_invariant=True, num_threads=1,
                                  lora_decode=lora_decode)
        try:
            futures = [server.submit(p, seed=40 + i, max_new_tokens=16, temperature=1.0, ignore_eos=True)
                       for i, p in enumerate(prompts)]
            answers = [(f.result(timeout=60).output_ids, f.result().output_logprobs) for f in futures]
            assert server.lora_decode == lora_decode and (server._decode_step.lowrank is not None) == (
                lora_decode == "lowrank")
        finally:
            server.shutdown()
        exact = ExactProx(model_dir, device=torch.device("cpu"), dtype=torch.float32, threads=1, block_size=16,
                          temperature=1.0, lora_decode=lora_decode)
        exact.load(engine)
        got = exact.logprobs([np.array(p) for p in prompts], [np.array(t) for t, _ in answers],
                             [np.ones(len(t), np.int64) for t, _ in answers])
    for (_, behav), lp in zip(answers, got):
        assert np.array_equal(lp, np.float32(behav))
