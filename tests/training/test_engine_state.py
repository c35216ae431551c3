"""The engine's state: LR schedules, skipped non-finite steps, checkpoints that resume exactly, weight
export, checkpoints that cannot be loaded, and packing against padding."""

import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers
from engine_helpers import (EXACT, assert_decayed_matrices_only, full_weights, make_seqs, make_token_data,
                            neg_mean_logprob, ppo_loss_fn, save_tiny_qwen2, zero_loss)
from safetensors.torch import load_file, save_file

from areal_flow.training.checkpoint_files import TRAIN_STATE
from areal_flow.training.engine import CheckpointError, NonFiniteLoss, OptimSpec
from areal_flow.training.schedule import lr_factor
from areal_flow.training.torch_engine import TorchEngine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"))


# ---------------------------------------------------------------- LR schedules


def test_weight_decay_shrinks_weight_matrices_but_not_biases_or_norms(model_dir):
    engine = TorchEngine(model_dir, optim=OptimSpec(lr=0.1, weight_decay=0.5))
    before = full_weights(engine)
    seqs = make_seqs(0, 4)
    engine.train_step(seqs, {}, zero_loss)
    assert_decayed_matrices_only(before, full_weights(engine), lr=0.1, weight_decay=0.5)


def test_warmup_then_linear_and_cosine_decay_to_the_floor():
    warm = [lr_factor(s, "linear", warmup_steps=4, decay_steps=14, min_ratio=0.1) for s in range(4)]
    assert warm == [0.25, 0.5, 0.75, 1.0]  # the first step already learns
    assert lr_factor(4, "linear", 4, 14, 0.1) == 1.0
    assert lr_factor(9, "linear", 4, 14, 0.1) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(9, "cosine", 4, 14, 0.1) == pytest.approx(0.1 + 0.9 * 0.5)  # cos(π/2) = 0: the midpoint
    assert lr_factor(6, "cosine", 4, 14, 0.0) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.2)))
    for schedule in ("linear", "cosine"):
        assert lr_factor(14, schedule, 4, 14, 0.1) == pytest.approx(0.1)
        assert lr_factor(1000, schedule, 4, 14, 0.1) == pytest.approx(0.1)  # stays at the floor
    assert [lr_factor(s, "constant", 2, 100, 0.5) for s in (0, 1, 2, 50)] == [0.5, 1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="unknown LR schedule 'exp'"):
        lr_factor(0, "exp")


def test_the_engine_steps_its_learning_rate_along_the_schedule(model_dir):
    engine = TorchEngine(model_dir, optim=OptimSpec(lr=0.01, schedule="linear", warmup_steps=2, decay_steps=4))
    lrs = [engine.train_step(make_seqs(s, 3), {}, neg_mean_logprob)["lr"] for s in range(6)]
    assert lrs == pytest.approx([0.005, 0.01, 0.01, 0.005, 0.0, 0.0])


# ---------------------------------------------------------------- non-finite steps


def nan_loss(logprobs, batch, mask, n_valid_tokens):
    return (logprobs * mask).sum() * float("nan"), {}


def test_a_nan_step_is_skipped_and_counted_and_too_many_in_a_row_stop_training(model_dir):
    engine = TorchEngine(model_dir, optim=OptimSpec(lr=0.01, schedule="linear", warmup_steps=3, max_nan_steps=2))
    seqs = make_seqs(0, 4)
    before = full_weights(engine)
    stats = engine.train_step(seqs, {}, nan_loss)
    assert stats["skipped_steps"] == 1.0 and not math.isfinite(stats["grad_norm"])
    assert all(torch.equal(before[k], v) for k, v in full_weights(engine).items())  # nothing changed
    assert engine.lr == pytest.approx(0.01 / 3)  # nor did the schedule move
    good = engine.train_step(seqs, {}, neg_mean_logprob)  # a good step resets the count
    assert good["skipped_steps"] == 0.0 and good["lr"] == pytest.approx(0.01 / 3)
    after_good = full_weights(engine)
    assert engine.train_step(seqs, {}, nan_loss)["skipped_steps"] == 1.0
    with pytest.raises(NonFiniteLoss, match="2 train steps in a row .*max_nan_steps=2"):
        engine.train_step(seqs, {}, nan_loss)
    assert all(torch.equal(after_good[k], v) for k, v in full_weights(engine).items())


# ---------------------------------------------------------------- checkpoints


RESUME_CHILD = """
import sys, torch
sys.path.insert(0, {helpers!r})
from engine_helpers import EXACT, full_weights, make_seqs, make_token_data, ppo_loss_fn
from areal_flow.training.torch_engine import TorchEngine
torch.set_num_threads({threads})  # as the test process: float sums in the same order
engine = TorchEngine({ckpt!r}, micro_batch_tokens=32, **EXACT)
engine.load({ckpt!r})
seqs = make_seqs(3, 6)
engine.train_step(seqs, make_token_data(seqs, 3), ppo_loss_fn)
torch.save({{"weights": full_weights(engine), "version": engine.version, "rng": torch.get_rng_state()}}, {out!r})
"""


@pytest.mark.slow  # processes of its own: the full suite runs it, the fast tier does not
def test_save_load_in_a_fresh_process_and_one_more_step_is_identical_to_not_stopping(model_dir, tmp_path):
    engine = TorchEngine(model_dir, micro_batch_tokens=32, **EXACT)
    for seed in (1, 2):
        seqs = make_seqs(seed, 6)
        engine.train_step(seqs, make_token_data(seqs, seed), ppo_loss_fn)
    engine.version = 2
    ckpt = str(tmp_path / "ckpt")
    engine.save(ckpt)
    rng = torch.get_rng_state()
    assert os.path.exists(os.path.join(ckpt, TRAIN_STATE))
    seqs = make_seqs(3, 6)
    engine.train_step(seqs, make_token_data(seqs, 3), ppo_loss_fn)

    out = tmp_path / "resumed.pt"
    child = RESUME_CHILD.format(helpers=os.path.dirname(__file__), ckpt=ckpt, out=str(out), threads=torch.get_num_threads())
    subprocess.run([sys.executable, "-c", child], check=True, timeout=120)
    resumed = torch.load(out)
    assert resumed["version"] == 2 and torch.equal(resumed["rng"], rng)
    continued = full_weights(engine)
    assert all(torch.equal(resumed["weights"][k], continued[k]) for k in continued)

    # The training state is what makes it exact: the same weights with a fresh optimizer differ.
    fresh = TorchEngine(ckpt, micro_batch_tokens=32, **EXACT)
    fresh.train_step(seqs, make_token_data(seqs, 3), ppo_loss_fn)
    assert not all(torch.equal(w, continued[k]) for k, w in full_weights(fresh).items())


def test_save_hf_has_no_training_state_and_save_of_a_frozen_role_neither(model_dir, tmp_path):
    TorchEngine(model_dir, optim=OptimSpec()).save_hf(str(tmp_path / "hf"))
    TorchEngine(model_dir).save(str(tmp_path / "ref"))
    assert not os.path.exists(tmp_path / "hf" / TRAIN_STATE)
    assert not os.path.exists(tmp_path / "ref" / TRAIN_STATE)
    assert os.path.exists(tmp_path / "hf" / "model.safetensors")


def _broken_copy(model_dir, dest, edit) -> str:
    """A copy of the checkpoint whose tensors went through `edit`."""
    os.makedirs(dest)
    for name in os.listdir(model_dir):
        if name != "model.safetensors":
            with open(os.path.join(model_dir, name), "rb") as src, open(os.path.join(dest, name), "wb") as dst:
                dst.write(src.read())
    tensors = load_file(os.path.join(model_dir, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(dest, "model.safetensors"), metadata={"format": "pt"})
    return str(dest)


def test_a_checkpoint_with_a_missing_or_misshapen_tensor_is_refused_naming_it(model_dir, tmp_path):
    missing = _broken_copy(model_dir, tmp_path / "missing", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match="tensor model.layers.1.mlp.up_proj.weight is missing"):
        TorchEngine(missing)

    def reshape(t):
        t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 16)

    wrong = _broken_copy(model_dir, tmp_path / "wrong", reshape)
    with pytest.raises(CheckpointError, match=r"model.layers.0.self_attn.k_proj.weight has shape \[8, 16\], "
                                              r"the model's config wants \[16, 32\]"):
        TorchEngine(wrong)

    engine = TorchEngine(model_dir, optim=OptimSpec())
    before = full_weights(engine)
    with pytest.raises(CheckpointError, match="k_proj.weight has shape"):
        engine.load(wrong)  # refused before anything is loaded
    assert all(torch.equal(before[k], v) for k, v in full_weights(engine).items())

    os.remove(os.path.join(missing, "model.safetensors"))
    with pytest.raises(CheckpointError, match="no \\*.safetensors weight file"):
        TorchEngine(missing)
    with pytest.raises(CheckpointError, match="no config.json"):
        TorchEngine(str(tmp_path))


def test_exported_weights_come_in_bounded_buckets_and_equal_the_saved_checkpoint(model_dir, tmp_path):
    engine = TorchEngine(model_dir, optim=OptimSpec(lr=0.01))
    engine.train_step(make_seqs(0, 4), {}, neg_mean_logprob)
    engine.save_weights(str(tmp_path / "w"))
    saved = load_file(str(tmp_path / "w" / "model.safetensors"))
    limit = 8 * 1024
    buckets = list(engine.export_weights(bucket_bytes=limit))
    assert len(buckets) > 3
    for bucket in buckets:
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= limit or len(bucket) == 1  # a tensor larger than a bucket travels alone
    exported = {name: t for bucket in buckets for name, t in bucket}
    assert exported.keys() == saved.keys()
    assert all(torch.equal(exported[k], saved[k]) for k in saved)


def test_tied_embeddings_save_and_load_once(tmp_path):
    tied = save_tiny_qwen2(tmp_path / "tied", tie_word_embeddings=True)
    engine = TorchEngine(tied, optim=OptimSpec(lr=0.01))
    engine.train_step(make_seqs(0, 4), {}, neg_mean_logprob)
    engine.save(str(tmp_path / "ckpt"))
    names = [n for bucket in engine.export_weights() for n, _ in bucket]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    loaded = TorchEngine(str(tmp_path / "ckpt"))
    seqs = make_seqs(5, 3)
    for a, b in zip(engine.logprobs(seqs), loaded.logprobs(seqs)):
        np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------- packing


def test_a_sequence_longer_than_the_micro_batch_budget_is_an_error_giving_both_numbers(model_dir):
    engine = TorchEngine(model_dir, optim=OptimSpec(), micro_batch_tokens=10)
    seqs = [(np.arange(4) % 18, np.arange(9) % 18)]
    with pytest.raises(ValueError, match="a sequence of 13 tokens does not fit the micro-batch budget of 10 tokens"):
        engine.train_step(seqs, {}, neg_mean_logprob)
    with pytest.raises(ValueError, match="13 tokens .* 10 tokens"):
        engine.logprobs(seqs)


def test_packed_and_padded_batches_give_the_same_loss_and_gradients(model_dir):
    seqs = make_seqs(7, 6, max_prompt=6, max_output=10)
    seqs = [(p, o) for p, o in seqs if len(o)]
    data = make_token_data(seqs, 7)

    engine = TorchEngine(model_dir, micro_batch_tokens=10_000, optim=OptimSpec(lr=0.0, grad_clip=0))
    grads = {}
    engine._optimizer.register_step_pre_hook(
        lambda *_: grads.update({n: p.grad.clone() for n, p in engine.model.named_parameters()}))
    packed_loss = engine.train_step(seqs, data, ppo_loss_fn)["loss"]

    # The same loss on a right-padded batch with an attention mask, through plain transformers.
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    width = max(len(p) + len(o) for p, o in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attention = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, (p, o) in enumerate(seqs):
        ids[i, :len(p) + len(o)] = torch.from_numpy(np.concatenate([p, o]))
        attention[i, :len(p) + len(o)] = 1
    logp = model(input_ids=ids, attention_mask=attention).logits.log_softmax(-1)
    per_seq = [logp[i, len(p) - 1:len(p) + len(o) - 1].gather(-1, torch.from_numpy(o)[:, None].long())[:, 0]
               for i, (p, o) in enumerate(seqs)]
    batch = {k: torch.from_numpy(np.concatenate(v)) for k, v in data.items()}
    n = sum(len(o) for _, o in seqs)
    padded_loss, _ = ppo_loss_fn(torch.cat(per_seq), batch, torch.ones(n, dtype=torch.bool), float(n))
    padded_loss.backward()

    assert packed_loss == pytest.approx(padded_loss.item(), abs=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-6, rtol=1e-5, msg=name)
