"""The megatron engine's fast-path options on gloo ranks, against its default path: the distributed
optimizer (DP=2), sequence parallelism and activation recomputation (TP=2) train to the same weights
within fp32 rounding; bf16 is megatron's mixed precision (bf16 parameters, fp32 master weights, also
sharded by the distributed optimizer) and resumes exactly. All of them run on the CPU
(cpu_compat.py); the GPU test runs them on CUDA."""

import dataclasses
import os

import pytest
import torch
import transformers
from engine_helpers import (SGD_LIKE, assert_all_close, assert_same_weights, full_weights, make_seqs,
                            make_token_data, ppo_loss_fn, reference_logprobs, run_ranks, save_tiny_qwen2)
from safetensors.torch import load_file

from areal_flow.training.engine import CheckpointError, OptimSpec

MBT = 40
# engine_helpers.EXACT's SGD-like step (weights compared across reduction orders), with a clip that
# every step hits (the tiny model's gradient norm is about 1), so that clipping on the distributed
# optimizer's shards counts.
CLIPPED = dict(optim=dataclasses.replace(SGD_LIKE, grad_clip=0.5))


def _shard(dp_rank: int, dp: int, seed: int):
    seqs = make_seqs(seed, 10, 8, 12)
    data = make_token_data(seqs, seed)
    lo, hi = (0, len(seqs)) if dp == 1 else [(0, 6), (6, len(seqs))][dp_rank]  # uneven on purpose
    return seqs[lo:hi], {k: v[lo:hi] for k, v in data.items()}, ppo_loss_fn


def _train(engine, steps=(0, 1)) -> list[dict]:
    return [engine.train_step(*_shard(engine.dp_rank, engine.layout.dp, seed)) for seed in steps]


def _assert_same_training(got: list[dict], want: list[dict]) -> None:
    for g, w in zip(got, want, strict=True):
        for key in ("loss", "grad_norm", "n_valid_tokens"):
            assert g[key] == pytest.approx(w[key], rel=1e-5), key


def _main_weights_numel(engine) -> int:
    """Elements of the weights this rank's optimizer updates (its fp32 main weights)."""
    from areal_flow.training.megatron.optimizer import inner_optimizers

    return sum(p.numel() for inner in inner_optimizers(engine._optimizer) for group in inner.optimizer.param_groups
               for p in group["params"])


# ---------------------------------------------------------------- DP=2: the distributed optimizer


def _distributed_optimizer_rank(rank, model_dir, out_dir):
    from areal_flow.training.megatron.engine import MegatronEngine
    from areal_flow.training.megatron.optimizer import inner_optimizers

    make = lambda **kw: MegatronEngine(model_dir, micro_batch_tokens=MBT, **CLIPPED, **kw)  # noqa: E731
    default, sharded = make(), make(distributed_optimizer=True)
    want, got = _train(default), _train(sharded)
    _assert_same_training(got, want)
    assert_same_weights(full_weights(sharded), full_weights(default))
    # The optimizer state is sharded: each rank updates about half of the weights.
    total = sum(t.numel() for t in full_weights(default).values())
    assert _main_weights_numel(default) == total
    assert 0.4 * total < _main_weights_numel(sharded) < 0.6 * total

    # bf16: megatron's mixed precision, with the distributed optimizer: bf16 parameters, fp32 master
    # weights sharded; near the fp32 path, and a non-finite step changes nothing on any rank.
    bf16 = make(distributed_optimizer=True, bf16=True)
    assert {p.dtype for p in bf16._gpt.parameters()} == {torch.bfloat16}
    assert {p.dtype for inner in inner_optimizers(bf16._optimizer) for g in inner.optimizer.param_groups
            for p in g["params"]} == {torch.float32}
    low = _train(bf16)
    assert all(g["loss"] == pytest.approx(w["loss"], rel=0.02) for g, w in zip(low, want))
    weights = full_weights(bf16)
    assert all(w.dtype == torch.float32 and torch.equal(w, w.bfloat16().float()) for w in weights.values())
    seqs, data, _ = _shard(bf16.dp_rank, 2, 0)
    nan = bf16.train_step(seqs, data, lambda lp, b, m, n: (lp.sum() * float("nan"), {}))
    assert nan["skipped_steps"] == 1.0
    assert_same_weights(full_weights(bf16), weights, atol=0)

    # Resume: the sharded Adam state and fp32 master weights come back exactly.
    ckpt = os.path.join(out_dir, "ckpt")
    bf16.save_resumable(ckpt)
    bf16.train_step(*_shard(bf16.dp_rank, 2, 2))
    resumed = MegatronEngine(ckpt, micro_batch_tokens=MBT, distributed_optimizer=True, bf16=True, **CLIPPED)
    resumed.load_resumable(ckpt)
    resumed.train_step(*_shard(resumed.dp_rank, 2, 2))
    assert_same_weights(full_weights(resumed), full_weights(bf16), atol=0)
    # ... into the same optimizer only.
    with pytest.raises(CheckpointError, match=r"saved with distributed_optimizer=True, bf16=True, "
                                              r"this engine has distributed_optimizer=False, bf16=False"):
        default.load_resumable(ckpt)
    # Weights loaded alone (a Hugging Face directory) become the fp32 master weights too: a step at
    # LR 0 keeps them (stale master weights would bring the trained ones back).
    resumed.load(model_dir)
    resumed.optim = dataclasses.replace(resumed.optim, lr=0.0)
    resumed.train_step(*_shard(resumed.dp_rank, 2, 3))
    initial = load_file(os.path.join(model_dir, "model.safetensors"))
    assert_same_weights(full_weights(resumed), {k: v.bfloat16().float() for k, v in initial.items()}, atol=0)


# ---------------------------------------------------------------- TP=2: sequence parallelism, recomputation


def _tensor_parallel_rank(rank, model_dir, out_dir):
    """Sequence parallelism and recomputation together against the default path (TP=2)."""
    from areal_flow.training.megatron.engine import MegatronEngine

    make = lambda **kw: MegatronEngine(model_dir, micro_batch_tokens=MBT, tp=2, **CLIPPED, **kw)  # noqa: E731
    default, fast = make(), make(sequence_parallel=True, activation_checkpointing=True)
    seqs = make_seqs(0, 10, 8, 12)
    assert_all_close(fast.logprobs(seqs), default.logprobs(seqs), atol=1e-5)
    # Rows split over 2 ranks: a row of odd length gets a padding sequence of its own.
    assert any(len(mb["cu_seqlens"]) > len(mb["index"]) + 1 for mb in fast._micro_batches(seqs, None, None))
    # Recomputation runs each layer's forward twice in a training pass (once for logprobs).
    calls = []
    fast._gpt.decoder.layers[0].register_forward_hook(lambda *_: calls.append(1))
    got = _train(fast)
    _assert_same_training(got, _train(default))
    assert len(calls) == 2 * sum(s["n_micro_batches"] for s in got)
    assert_same_weights(full_weights(fast), full_weights(default))


def _pipeline_rank(rank, model_dir, out_dir):
    """Recomputation on both pipeline stages (the second recomputes from the activations it was
    sent), in fp32 and in bf16 (PP=2)."""
    from areal_flow.training.megatron.engine import MegatronEngine

    make = lambda **kw: MegatronEngine(model_dir, micro_batch_tokens=MBT, pp=2, **CLIPPED, **kw)  # noqa: E731
    default, recomputing = make(), make(activation_checkpointing=True)
    want = _train(default)
    _assert_same_training(_train(recomputing), want)
    assert_same_weights(full_weights(recomputing), full_weights(default))
    low = _train(make(activation_checkpointing=True, bf16=True))
    assert all(g["loss"] == pytest.approx(w["loss"], rel=0.02) for g, w in zip(low, want))


def _fast_path_rank(rank, model_dir, out_dir):
    """Every layout in one pair of processes (starting them, megatron's import most of all, is what
    costs): megatron's parallel state is rebuilt in between."""
    from megatron.core import parallel_state

    for layout in (_distributed_optimizer_rank, _tensor_parallel_rank, _pipeline_rank):
        layout(rank, model_dir, out_dir)
        parallel_state.destroy_model_parallel()
    open(os.path.join(out_dir, f"rank{rank}.ok"), "w").close()


@pytest.mark.slow  # processes of their own (megatron's parallel state is per process)
def test_the_distributed_optimizer_sequence_parallelism_and_recomputation_train_as_the_default_path(tmp_path):
    model_dir = save_tiny_qwen2(tmp_path / "model")
    run_ranks(_fast_path_rank, 2, model_dir, str(tmp_path), timeout=240)
    assert all((tmp_path / f"rank{r}.ok").exists() for r in range(2))


def test_sequence_parallelism_without_tensor_parallelism_is_refused(tmp_path):
    from areal_flow.training.megatron.engine import MegatronEngine

    with pytest.raises(ValueError, match=r"sequence_parallel=True needs tensor parallelism \(tp > 1\); "
                                         r"this layout has tp=1"):
        MegatronEngine(save_tiny_qwen2(tmp_path / "model"), tp=1, sequence_parallel=True)


def test_cpu_mode_names_cpu_tensors_as_the_cuda_ones_megatron_accepts():
    from areal_flow.training.megatron.cpu_compat import cpu_mode

    with cpu_mode():
        assert torch.zeros(1).type() == "torch.cuda.FloatTensor"
        assert torch.zeros(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
        assert torch.zeros(1).type(torch.float64).dtype == torch.float64  # a conversion stays one
    assert torch.zeros(1).type() == "torch.FloatTensor"


# ---------------------------------------------------------------- CUDA


def _on_cuda_fast_path_rank(rank, model_dir, out_dir):
    """Every option that one GPU can run together: bf16 with fp32 master weights, the distributed
    optimizer, recomputation; near the CPU reference, and training. In fp32, recomputation agrees
    with the default path."""
    from areal_flow.training.megatron.engine import MegatronEngine

    torch.backends.cuda.matmul.allow_tf32 = False
    seqs = make_seqs(0, 8, 8, 12)
    reference = reference_logprobs(transformers.AutoModelForCausalLM.from_pretrained(model_dir), seqs)
    fast = MegatronEngine(model_dir, micro_batch_tokens=MBT, device="cuda", bf16=True, distributed_optimizer=True,
                          activation_checkpointing=True, **CLIPPED)
    assert {p.dtype for p in fast._gpt.parameters()} == {torch.bfloat16}
    assert_all_close(fast.logprobs(seqs), reference, atol=0.05)
    stats = _train(fast, steps=(0, 1, 2))
    assert all(s["skipped_steps"] == 0.0 and 0 < s["grad_norm"] < float("inf") for s in stats)
    assert all(t.dtype == torch.float32 for t in full_weights(fast).values())
    plain, recomputing = (MegatronEngine(model_dir, micro_batch_tokens=MBT, device="cuda", activation_checkpointing=ac,
                                         **CLIPPED) for ac in (False, True))
    _assert_same_training(_train(recomputing), _train(plain))
    assert_same_weights(full_weights(recomputing), full_weights(plain), atol=1e-5)
    open(os.path.join(out_dir, "cuda.ok"), "w").close()


@pytest.mark.gpu
def test_on_cuda_bf16_the_distributed_optimizer_and_recomputation_train(tmp_path):
    model_dir = save_tiny_qwen2(tmp_path / "m")
    run_ranks(_on_cuda_fast_path_rank, 1, model_dir, str(tmp_path), backend="cpu:gloo,cuda:nccl")
    assert (tmp_path / "cuda.ok").exists()
