"""The megatron engine against the torch engine (itself pinned to Hugging Face), on real gloo ranks.

Each layout runs in spawned processes (megatron's parallel state is per process): TP=2 splits every
layer, PP=2 splits the layers into stages (with tied embeddings, whose gradients then cross
stages), DP=2 gives the ranks different sequences and different numbers of micro-batches. Checks
that need megatron in a process of one of these layouts (weight decay under TP, refusing another
layout's training state) run in the same processes, since each start imports megatron anew.
"""

import os

import pytest
import torch
import transformers
from engine_helpers import (EXACT, assert_all_close, assert_decayed_matrices_only, assert_same_weights, full_weights,
                            make_seqs, make_token_data, ppo_loss_fn, reference_logprobs, run_ranks, save_tiny_qwen2,
                            zero_loss)

from areal_flow.graph.layout import Layout, layout_problems, parse_layout
from areal_flow.training.checkpoint_files import TRAIN_STATE
from areal_flow.training.engine import CheckpointError
from areal_flow.training.megatron import convert
from areal_flow.training.torch_engine import TorchEngine

MBT = 40  # a micro-batch budget that makes several micro-batches of the test sequences
TEMPERATURE = 0.7


def _shards(dp: int, n: int) -> list[tuple[int, int]]:
    # Uneven on purpose: with DP=2 the ranks get different numbers of micro-batches.
    return [(0, n)] if dp == 1 else [(0, 8), (8, n)]


def _steps():
    for seed in (0, 1):
        seqs = make_seqs(seed, 10, 8, 12)
        yield seqs, make_token_data(seqs, seed)


def _layout_rank(rank, model_dir, tp, pp, out_dir):
    from areal_flow.training.megatron.engine import MegatronEngine

    engine = MegatronEngine(model_dir, micro_batch_tokens=MBT, tp=tp, pp=pp, **EXACT)
    ref = MegatronEngine(model_dir, micro_batch_tokens=MBT, tp=tp, pp=pp, temperature=TEMPERATURE)  # frozen role
    dp_rank = engine.dp_rank
    result = {"dp_rank": dp_rank, "logprobs": [], "ref_logprobs": [], "stats": []}
    for seqs, data in _steps():
        lo, hi = _shards(engine.layout.dp, len(seqs))[dp_rank]
        result["logprobs"].append(engine.logprobs(seqs[lo:hi]))
        result["ref_logprobs"].append(ref.logprobs(seqs[lo:hi]))
        result["stats"].append(engine.train_step(seqs[lo:hi], {k: v[lo:hi] for k, v in data.items()}, ppo_loss_fn))
    result["weights"] = full_weights(engine)
    # A non-finite loss: the step is skipped and counted, and changes nothing.
    seqs, data = next(_steps())
    lo, hi = _shards(engine.layout.dp, len(seqs))[dp_rank]
    nan_stats = engine.train_step(seqs[lo:hi], {k: v[lo:hi] for k, v in data.items()},
                                  lambda lp, b, m, n: (lp.sum() * float("nan"), {}))
    assert nan_stats["skipped_steps"] == 1.0
    assert_same_weights(full_weights(engine), result["weights"], atol=0)
    # Resume: save, then one more step here; fresh processes load the checkpoint and take the same
    # step (_resume_rank).
    engine.version = 5
    ckpt = os.path.join(out_dir, "ckpt")
    result["ckpt_logprobs"] = engine.logprobs(seqs[lo:hi])
    engine.save(ckpt)
    engine.train_step(*_resume_shard(engine))
    result["continued"] = full_weights(engine)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def _resume_shard(engine):
    seqs, data = next(_steps())
    lo, hi = _shards(engine.layout.dp, len(seqs))[engine.dp_rank]
    return seqs[lo:hi], {k: v[lo:hi] for k, v in data.items()}, ppo_loss_fn


def _resume_rank(rank, tp, pp, out_dir, model_dir, also):
    from areal_flow.training.megatron.engine import MegatronEngine

    ckpt = os.path.join(out_dir, "ckpt")
    resumed = MegatronEngine(ckpt, micro_batch_tokens=MBT, tp=tp, pp=pp, **EXACT)
    resumed.load(ckpt)
    assert resumed.version == 5
    resumed.train_step(*_resume_shard(resumed))
    torch.save(full_weights(resumed), os.path.join(out_dir, f"resumed{rank}.pt"))
    if also is not None:  # another check of this layout, in processes that already run megatron
        also(rank, model_dir, out_dir)


def _refuses_another_layouts_state(rank, model_dir, out_dir):
    """Training state saved by another layout is refused naming both, and changes nothing."""
    from areal_flow.training.megatron.engine import MegatronEngine

    engine = MegatronEngine(model_dir, micro_batch_tokens=MBT, **EXACT)
    engine.train_step(*(lambda s: (s, make_token_data(s, 0), ppo_loss_fn))(make_seqs(0, 4)))
    ckpt = os.path.join(out_dir, "ckpt_mismatched")
    engine.save(ckpt)
    state = torch.load(os.path.join(ckpt, TRAIN_STATE), weights_only=True)
    state["layout"] = str(Layout(tp=2))  # as if a TP=2 run had saved it
    torch.save(state, os.path.join(ckpt, TRAIN_STATE))
    before = full_weights(engine)
    with pytest.raises(CheckpointError, match=r"saved by layout d1p1t2, this run is d1p1t1"):
        engine.load(ckpt)
    assert_same_weights(full_weights(engine), before, atol=0)  # nothing was changed
    open(os.path.join(out_dir, f"refused{rank}.ok"), "w").close()


def _decays_matrices_only(rank, model_dir, out_dir):
    """Weight decay follows the torch engine's rule under TP: weight matrices only."""
    from areal_flow.training.engine import OptimSpec
    from areal_flow.training.megatron.engine import MegatronEngine

    engine = MegatronEngine(model_dir, optim=OptimSpec(lr=0.1, weight_decay=0.5), tp=2)
    before = full_weights(engine)
    engine.train_step(make_seqs(0, 4), {}, zero_loss)
    assert_decayed_matrices_only(before, full_weights(engine), lr=0.1, weight_decay=0.5)
    open(os.path.join(out_dir, f"decayed{rank}.ok"), "w").close()


def _skips_answers_without_a_gradient(rank, model_dir, out_dir):
    """Across pipeline stages, skipping the answers whose advantages are 0 updates as running them."""
    import numpy as np

    from areal_flow.training.megatron.engine import MegatronEngine

    seqs = make_seqs(7, 9)
    data = make_token_data(seqs, 7)
    skip = [i % 3 == 0 for i in range(len(seqs))]
    data["advantages"] = [np.zeros(len(a)) if s else a for a, s in zip(data["advantages"], skip)]
    full, skipping = (MegatronEngine(model_dir, micro_batch_tokens=MBT, pp=2, **EXACT) for _ in range(2))
    ref = full.train_step(seqs, data, ppo_loss_fn)
    got = skipping.train_step(seqs, data, ppo_loss_fn, skip=skip)
    assert_same_weights(full_weights(skipping), full_weights(full))
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert got["skipped_tokens"] == sum(len(o) for (_, o), s in zip(seqs, skip) if s) > 0
    # Every answer skipped (a batch of equal rewards): no pass runs, and the step is still taken.
    data["advantages"] = [np.zeros(len(a)) for a in data["advantages"]]
    full.train_step(seqs, data, ppo_loss_fn)
    skipping.train_step(seqs, data, ppo_loss_fn, skip=[True] * len(seqs))
    assert_same_weights(full_weights(skipping), full_weights(full))
    open(os.path.join(out_dir, f"skipped{rank}.ok"), "w").close()


LAYOUTS = {  # name: (tp, pp, world, tied embeddings, another check run in the resume processes)
    "single": (1, 1, 1, False, _refuses_another_layouts_state),
    "tp2": (2, 1, 2, False, _decays_matrices_only),
    "pp2_tied": (1, 2, 2, True, _skips_answers_without_a_gradient),
    "dp2": (1, 1, 2, False, None),
}


@pytest.mark.slow  # processes of its own: the full suite runs it, the fast tier does not
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_computes_and_trains_like_the_torch_engine(name, tmp_path):
    tp, pp, world, tied, also = LAYOUTS[name]
    model_dir = save_tiny_qwen2(tmp_path / "model", tie_word_embeddings=tied)
    run_ranks(_layout_rank, world, model_dir, tp, pp, str(tmp_path), timeout=240)
    run_ranks(_resume_rank, world, tp, pp, str(tmp_path), model_dir, also, timeout=240)
    if also is not None:  # it ran, on every rank (a failed assertion there fails run_ranks)
        marker = {_refuses_another_layouts_state: "refused", _decays_matrices_only: "decayed",
                  _skips_answers_without_a_gradient: "skipped"}[also]
        assert all((tmp_path / f"{marker}{r}.ok").exists() for r in range(world))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) | {"resumed": torch.load(tmp_path / f"resumed{r}.pt")}
             for r in range(world)]
    dp = world // (tp * pp)

    torch_engine = TorchEngine(model_dir, micro_batch_tokens=MBT, **EXACT)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for step, (seqs, data) in enumerate(_steps()):
        expected = torch_engine.logprobs(seqs)
        want = torch_engine.train_step(seqs, data, ppo_loss_fn)
        for result in ranks:
            lo, hi = _shards(dp, len(seqs))[result["dp_rank"]]
            # Every rank returns the logprobs of its DP shard, also the stages that are not the last.
            assert_all_close(result["logprobs"][step], expected[lo:hi], atol=1e-5)
            if step == 0:
                assert_all_close(result["ref_logprobs"][0], reference_logprobs(hf, seqs[lo:hi], TEMPERATURE), atol=1e-5)
            got = result["stats"][step]
            for key in ("loss", "grad_norm", "n_tokens", "n_valid_tokens", "clipped_tokens", "behav_weight_sum"):
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (name, step, key)
    if dp == 2:  # the case DP=2 exists for: the ranks ran different numbers of micro-batches
        assert ranks[0]["stats"][0]["n_micro_batches"] != ranks[1]["stats"][0]["n_micro_batches"]
    for result in ranks:
        assert_same_weights(result["weights"], full_weights(torch_engine))
        assert all(torch.equal(result["resumed"][k], result["continued"][k]) for k in result["continued"])

    # The checkpoint is a Hugging Face directory that transformers loads, with the trained weights.
    saved = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32)
    assert_same_weights({k: v for k, v in saved.named_parameters()}, ranks[0]["weights"], atol=0)
    assert saved.config.tie_word_embeddings == tied
    # ... and transformers computes from it what the engine computed before saving.
    seqs, _ = next(_steps())
    for result in ranks:
        lo, hi = _shards(dp, len(seqs))[result["dp_rank"]]
        assert_all_close(result["ckpt_logprobs"], reference_logprobs(saved, seqs[lo:hi]), atol=1e-5)


def _save_alone(rank, model_dir, out_dir):
    """One rank trains a step, saves a resumable checkpoint, then trains the next step on the whole batch."""
    from areal_flow.training.engine import OptimSpec
    from areal_flow.training.megatron.engine import MegatronEngine

    engine = MegatronEngine(model_dir, optim=OptimSpec(lr=1e-2), micro_batch_tokens=MBT)
    steps = list(_steps())
    engine.train_step(*steps[0], ppo_loss_fn)
    engine.version = 3
    engine.save_resumable(os.path.join(out_dir, "resumable"))
    engine.train_step(*steps[1], ppo_loss_fn)
    torch.save(full_weights(engine), os.path.join(out_dir, "alone.pt"))


def _resume_on_two(rank, out_dir):
    """Two data-parallel ranks load it (each rank 0's whole optimizer state) and train that next step, each its half."""
    from areal_flow.training.engine import OptimSpec
    from areal_flow.training.megatron.engine import MegatronEngine

    ckpt = os.path.join(out_dir, "resumable")
    engine = MegatronEngine(ckpt, optim=OptimSpec(lr=1e-2), micro_batch_tokens=MBT)
    engine.load_resumable(ckpt)
    assert engine.version == 3 and engine.layout.dp == 2
    seqs, data = list(_steps())[1]
    lo, hi = _shards(2, len(seqs))[engine.dp_rank]
    engine.train_step(seqs[lo:hi], {k: v[lo:hi] for k, v in data.items()}, ppo_loss_fn)
    torch.save(full_weights(engine), os.path.join(out_dir, f"two{rank}.pt"))
    # The same weights with a fresh optimizer take another step: the state is what made it the same.
    fresh = MegatronEngine(ckpt, optim=OptimSpec(lr=1e-2), micro_batch_tokens=MBT)
    fresh.train_step(seqs[lo:hi], {k: v[lo:hi] for k, v in data.items()}, ppo_loss_fn)
    torch.save(full_weights(fresh), os.path.join(out_dir, f"fresh{rank}.pt"))


@pytest.mark.slow
def test_a_resumable_checkpoint_of_one_rank_resumes_on_two_data_parallel_ranks(tmp_path):
    # A trainer resize (`scale RUN_DIR trainers=2`) with the megatron engine: tp = pp = 1, the
    # optimizer not distributed, so every rank's state is whole and the new ranks each take rank 0's.
    model_dir = save_tiny_qwen2(tmp_path / "model")
    run_ranks(_save_alone, 1, model_dir, str(tmp_path), timeout=240)
    run_ranks(_resume_on_two, 2, str(tmp_path), timeout=240)
    alone = torch.load(tmp_path / "alone.pt")
    for r in range(2):  # the same step as one rank on the whole batch: Adam's moments came back
        assert_same_weights(torch.load(tmp_path / f"two{r}.pt"), alone)
        fresh = torch.load(tmp_path / f"fresh{r}.pt")
        assert any((fresh[k] - alone[k]).abs().max() > 1e-4 for k in alone)


# ---------------------------------------------------------------- conversion


HEADS = convert.Heads(n_heads=8, n_groups=4, head_dim=3)
HIDDEN, FFN, VOCAB = 24, 16, 12


def _hf_tensors(kind):
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    return {
        "replicated": [rand(HIDDEN)],
        "column": [rand(VOCAB, HIDDEN)],
        "row": [rand(HIDDEN, FFN)],
        "fc1": [rand(FFN, HIDDEN), rand(FFN, HIDDEN)],
        "qkv": [rand(8 * 3, HIDDEN), rand(4 * 3, HIDDEN), rand(4 * 3, HIDDEN)],
        "qkv_bias": [rand(8 * 3), rand(4 * 3), rand(4 * 3)],
    }[kind]


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("kind", ["replicated", "column", "row", "fc1", "qkv", "qkv_bias"])
def test_conversion_round_trips_exactly(kind, tp):
    hf = _hf_tensors(kind)
    rule_kind = "qkv" if kind == "qkv_bias" else kind
    shards = [convert.to_megatron(rule_kind, hf, tp, r, HEADS) for r in range(tp)]
    assert len({s.shape for s in shards}) == 1  # every TP rank holds an equal shard
    back = convert.to_hf(rule_kind, shards, HEADS)
    assert len(back) == len(hf) and all(torch.equal(a, b) for a, b in zip(back, hf))


def test_fused_qkv_is_ordered_by_query_group_so_tp_shards_hold_whole_groups():
    q, k, v = _hf_tensors("qkv")
    shard = convert.to_megatron("qkv", [q, k, v], 2, 1, HEADS)  # TP rank 1: query groups 2 and 3
    d, per_group = HEADS.head_dim, HEADS.n_heads // HEADS.n_groups
    for local, group in enumerate((2, 3)):
        rows = shard[local * (per_group + 2) * d:(local + 1) * (per_group + 2) * d]
        torch.testing.assert_close(rows[:per_group * d], q[group * per_group * d:(group + 1) * per_group * d])
        torch.testing.assert_close(rows[per_group * d:(per_group + 1) * d], k[group * d:(group + 1) * d])
        torch.testing.assert_close(rows[(per_group + 1) * d:], v[group * d:(group + 1) * d])


def test_fc1_shard_is_gate_shard_then_up_shard():
    gate, up = _hf_tensors("fc1")
    shard = convert.to_megatron("fc1", [gate, up], 2, 1, HEADS)
    torch.testing.assert_close(shard, torch.cat([gate[FFN // 2:], up[FFN // 2:]]))


def test_every_parameter_of_a_layer_has_a_rule_naming_its_global_layer():
    rule = convert.rule("decoder.layers.1.mlp.linear_fc1.weight", {0: 2, 1: 3})  # the second stage's layers
    assert rule.hf_names == ("model.layers.3.mlp.gate_proj.weight", "model.layers.3.mlp.up_proj.weight")
    with pytest.raises(KeyError, match="decoder.layers.0.mlp.router.weight"):
        convert.rule("decoder.layers.0.mlp.router.weight", {0: 0})


# ---------------------------------------------------------------- layouts


@pytest.mark.parametrize("spec, want", [
    (None, Layout()), ("d2p2t2", Layout(2, 2, 2)), ("t4", Layout(tp=4)), ("p2d4", Layout(dp=4, pp=2)),
    ({"tp": 2, "dp": 2}, Layout(dp=2, tp=2)),
])
def test_layouts_parse_from_a_mapping_or_the_compact_string(spec, want):
    assert parse_layout(spec, "graph.train.parallel") == want


@pytest.mark.parametrize("spec, message", [
    ("d2x2", r"graph.train.parallel: 'd2x2' is not a layout like 'd2p2t2'.*character 3"),
    ("d2d2", r"'d2d2' gives 'd' twice"),
    ("", r"is not a layout"),
    ({"tp": 0}, r"tp=0 must be an integer >= 1"),
    ({"sp": 2}, r"unknown key 'sp'"),
    (3, r"neither a mapping"),
])
def test_bad_layouts_are_refused_naming_the_key_and_the_fault(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_layout(spec, "graph.train.parallel")


def test_layout_problems_name_the_number_that_does_not_fit():
    model = transformers.Qwen2Config(vocab_size=18, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2)
    assert layout_problems(Layout(dp=2, tp=2), n_devices=4, model=model, where="w") == []
    problems = layout_problems(Layout(tp=4, pp=3), n_devices=8, model=model, where="graph.train")
    assert problems == [
        "graph.train: layout d1p3t4 needs dp·tp·pp = 1·4·3 = 12 devices, the mesh has 8",
        "graph.train: tp=4 does not divide the model's key/value heads (2)",
        "graph.train: tp=4 does not divide the model's vocabulary (18)",
        "graph.train: pp=3 is more than the model's 2 layers",
    ]


def test_the_engine_refuses_a_model_or_layout_it_would_get_wrong(tmp_path):
    from areal_flow.training.megatron.engine import MegatronEngine

    model_dir = save_tiny_qwen2(tmp_path / "model")
    with pytest.raises(ValueError, match=r"tp=4 does not divide the model's key/value heads \(2\)"):
        MegatronEngine(model_dir, tp=4)
    gpt2 = tmp_path / "gpt2"
    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=18)).save_pretrained(gpt2)
    with pytest.raises(ValueError, match=r"gpt2/config.json: model_type 'gpt2' is not supported by the megatron engine"):
        MegatronEngine(str(gpt2))


def _on_cuda_rank(rank, model_dir, out_dir):
    """fp32 on the GPU agrees with Hugging Face on the CPU; bf16 with fp32 master weights stays near
    it and trains."""
    from areal_flow.training.megatron.engine import MegatronEngine

    torch.backends.cuda.matmul.allow_tf32 = False
    seqs = make_seqs(0, 8, 8, 12)
    reference = reference_logprobs(transformers.AutoModelForCausalLM.from_pretrained(model_dir), seqs, TEMPERATURE)
    fp32 = MegatronEngine(model_dir, micro_batch_tokens=MBT, temperature=TEMPERATURE, device="cuda")
    assert_all_close(fp32.logprobs(seqs), reference, atol=1e-4)
    bf16 = MegatronEngine(model_dir, micro_batch_tokens=MBT, temperature=TEMPERATURE, device="cuda", bf16=True,
                          **EXACT)
    assert_all_close(bf16.logprobs(seqs), reference, atol=0.05)
    data = make_token_data(seqs, 0)
    losses = [bf16.train_step(seqs, data, ppo_loss_fn)["loss"] for _ in range(3)]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert all(t.dtype == torch.float32 for t in full_weights(bf16).values())
    open(os.path.join(out_dir, "cuda.ok"), "w").close()


@pytest.mark.gpu
def test_on_cuda_the_engine_agrees_with_the_cpu_reference_and_trains_in_bf16(tmp_path):
    model_dir = save_tiny_qwen2(tmp_path / "m")
    run_ranks(_on_cuda_rank, 1, model_dir, str(tmp_path), backend="cpu:gloo,cuda:nccl")
    assert (tmp_path / "cuda.ok").exists()
