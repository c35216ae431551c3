import os

import numpy as np
import pytest
import safetensors.torch
import torch
import torch.distributed as dist
import transformers
from engine_helpers import (EXACT, VOCAB, assert_all_close, assert_same_weights, full_weights, make_seqs, make_token_data,
                            neg_mean_logprob, ppo_loss_fn, reference_logprobs, run_ranks, save_tiny_qwen2,
                            tiny_tokenizer)
from safetensors import safe_open
from safetensors.torch import load_file

from areal_flow.algorithms.library import aggregation
from areal_flow.algorithms.packing import ffd_allocate
from areal_flow.algorithms.ppo import decoupled_ppo_loss
from areal_flow.config.schema import AlgorithmConfig
from areal_flow.training.checkpoint_files import saved_layout
from areal_flow.training.engine import LOSS_SHARE_KEY, OptimSpec
from areal_flow.training.torch_engine import TorchEngine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_a_full_sequence_hf_forward(model_dir, temperature):
    engine = TorchEngine(model_dir, temperature=temperature, micro_batch_tokens=40)
    seqs = make_seqs(0, 12)
    got = engine.logprobs(seqs)
    assert [len(g) for g in got] == [len(o) for _, o in seqs]
    assert all(g.dtype == np.float32 for g in got)
    assert_all_close(got, reference_logprobs(engine.model, seqs, temperature), atol=1e-5)


def test_packed_logprobs_equal_unpacked(model_dir):
    seqs = make_seqs(1, 10)
    one_row = TorchEngine(model_dir, micro_batch_tokens=10_000)
    assert len(ffd_allocate([len(p) + len(o) for p, o in seqs], 10_000)) == 1  # really one packed row
    packed, unpacked = one_row.logprobs(seqs), [one_row.logprobs([s])[0] for s in seqs]
    assert_all_close(packed, unpacked, atol=1e-5)

    # The comparison can fail: concatenating without restarting positions lets sequences see each other.
    ids = torch.from_numpy(np.concatenate([np.concatenate([p, o]) for p, o in seqs]))[None]
    with torch.no_grad():
        leaky = one_row.model(ids).logits[0].log_softmax(-1)
    p1, o1 = seqs[1]
    start = len(seqs[0][0]) + len(seqs[0][1]) + len(p1) - 1
    leaky_lp = leaky[torch.arange(start, start + len(o1)), torch.from_numpy(o1)].numpy()
    assert np.abs(leaky_lp - packed[1]).max() > 1e-3


def test_packed_rows_in_one_call_give_the_logprobs_and_update_of_one_row(model_dir):
    seqs = make_seqs(4, 12) + [(np.arange(9) % 18, np.arange(14) % 18)]  # the last is longer than a row
    data = make_token_data(seqs, 4)
    one_row = TorchEngine(model_dir, micro_batch_tokens=10_000, **EXACT)
    rows = TorchEngine(model_dir, micro_batch_tokens=10_000, row_tokens=16, **EXACT)
    shapes = []
    rows.model.register_forward_pre_hook(lambda _, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)),
                                         with_kwargs=True)
    got = rows.logprobs(seqs)
    lengths = [len(p) + len(o) for p, o in seqs]
    expected_rows = ffd_allocate(lengths, 16)
    # One call of several rows; the long sequence has a row of its own, which sets the width, and
    # every shorter row ends in a dummy sequence.
    assert shapes == [(len(expected_rows), 23)] and len(expected_rows) > 3
    assert_all_close(got, one_row.logprobs(seqs), atol=1e-5)
    assert_all_close(got, reference_logprobs(one_row.model, seqs), atol=1e-5)

    s_one, s_rows = one_row.train_step(seqs, data, ppo_loss_fn), rows.train_step(seqs, data, ppo_loss_fn)
    assert s_rows["n_micro_batches"] == s_one["n_micro_batches"] == 1
    for key in ("loss", "grad_norm", "clipped_tokens", "capped_tokens"):
        assert s_rows[key] == pytest.approx(s_one[key], rel=1e-5, abs=1e-7), key
    assert_same_weights(full_weights(rows), full_weights(one_row))


def test_train_step_lowers_the_loss_and_reports_counts(model_dir):
    engine = TorchEngine(model_dir, optim=OptimSpec(lr=1e-2), micro_batch_tokens=30)
    seqs = make_seqs(2, 8)
    mask = [np.arange(len(o)) % 3 != 0 for _, o in seqs]  # a third of the tokens do not count
    n_valid = sum(int(m.sum()) for m in mask)

    def masked_mean(logprobs_per_seq):
        return sum(float((lp * m).sum()) for lp, m in zip(logprobs_per_seq, mask)) / n_valid

    before = masked_mean(engine.logprobs(seqs))
    stats = engine.train_step(seqs, {"loss_mask": mask}, neg_mean_logprob)
    # The reported loss is the global masked token mean at the weights before the update.
    assert stats["loss"] == pytest.approx(-before, abs=1e-5)
    assert stats["n_valid_tokens"] == n_valid
    assert stats["n_tokens"] == sum(len(p) + len(o) for p, o in seqs)
    assert stats["n_micro_batches"] == len(ffd_allocate([len(p) + len(o) for p, o in seqs], 30)) > 1
    assert stats["grad_norm"] > 0 and stats["step_seconds"] > 0
    for _ in range(2):
        engine.train_step(seqs, {"loss_mask": mask}, neg_mean_logprob)
    assert masked_mean(engine.logprobs(seqs)) > before + 0.05


def test_micro_batching_does_not_change_the_update(model_dir):
    seqs = make_seqs(3, 10)
    data = make_token_data(seqs, 3)
    few = TorchEngine(model_dir, micro_batch_tokens=10_000, **EXACT)
    many = TorchEngine(model_dir, micro_batch_tokens=20, **EXACT)
    s_few = few.train_step(seqs, data, ppo_loss_fn)
    s_many = many.train_step(seqs, data, ppo_loss_fn)
    assert s_few["n_micro_batches"] == 1 and s_many["n_micro_batches"] > 3
    assert s_few["clipped_tokens"] > 0 and s_few["capped_tokens"] > 0  # every branch of the loss is hit
    assert s_many["grad_norm"] == pytest.approx(s_few["grad_norm"], rel=1e-5)
    for key in ("loss", "clipped_tokens", "capped_tokens", "behav_weight_sum", "behav_weight_max"):
        assert s_many[key] == pytest.approx(s_few[key], rel=1e-5, abs=1e-7), key
    assert_same_weights(full_weights(few), full_weights(many))


def test_token_data_that_does_not_match_the_outputs_is_rejected(model_dir):
    engine = TorchEngine(model_dir, optim=OptimSpec())
    seqs = [(np.array([1, 2]), np.array([3, 4, 5]))]
    with pytest.raises(ValueError, match=r"token_data\['advantages'\]\[0\] has 2 values for 3 output tokens"):
        engine.train_step(seqs, {"advantages": [np.zeros(2)]}, neg_mean_logprob)


# ---------------------------------------------------------------- data parallel

# (name, micro_batch_tokens, row_tokens, steps); each step is (seed, sequences on rank 0, on rank 1).
DP_SCENARIOS = [
    ("uneven_micro_batches", 24, None, [(10, 3, 5), (11, 4, 4)]),
    ("empty_rank", 24, None, [(12, 6, 0)]),
    ("rows_per_call", 40, 14, [(13, 5, 3)]),
]


def _dp_step_data(seed, n0, n1):
    # Rank 0 gets long sequences, rank 1 short ones, so their natural micro-batch counts differ.
    long, short = make_seqs(seed, n0, 10, 14), make_seqs(seed + 100, n1, 2, 3)
    seqs = long + short
    return seqs, make_token_data(seqs, seed), [(0, n0), (n0, n0 + n1)]


def _dp_rank(rank, model_dir, out_dir):
    for name, mbt, rows, steps in DP_SCENARIOS:
        engine = TorchEngine(model_dir, micro_batch_tokens=mbt, row_tokens=rows, process_group=dist.group.WORLD,
                             **EXACT)
        layer = engine.model.model.layers[0].mlp.up_proj.weight
        assert layer.to_local().numel() == layer.numel() // 2  # FSDP2 really shards the parameters
        result = {"stats": [], "logprobs": []}
        for seed, n0, n1 in steps:
            seqs, data, shards = _dp_step_data(seed, n0, n1)
            lo, hi = shards[rank]
            result["logprobs"].append(engine.logprobs(seqs[lo:hi]))
            result["stats"].append(engine.train_step(seqs[lo:hi], {k: v[lo:hi] for k, v in data.items()}, ppo_loss_fn))
        result["weights"] = full_weights(engine)
        for v in (1, 2):  # the second save writes rank 0's gathered weights without save_pretrained
            engine.save_weights(os.path.join(out_dir, f"{name}_weights_v{v}"))
        # Resume: save, then one more step, against a fresh engine loaded from the checkpoint.
        engine.version = 7
        ckpt = os.path.join(out_dir, f"{name}_ckpt")
        engine.save(ckpt)
        seqs, data, shards = _dp_step_data(99, 5, 4)
        lo, hi = shards[rank]
        shard = (seqs[lo:hi], {k: v[lo:hi] for k, v in data.items()}, ppo_loss_fn)
        engine.train_step(*shard)
        resumed = TorchEngine(ckpt, micro_batch_tokens=mbt, row_tokens=rows, process_group=dist.group.WORLD, **EXACT)
        resumed.load(ckpt)
        assert resumed.version == 7
        resumed.train_step(*shard)
        result["continued"], result["resumed"] = full_weights(engine), full_weights(resumed)
        torch.save(result, os.path.join(out_dir, f"{name}_{rank}.pt"))


@pytest.mark.slow  # processes of its own: the full suite runs it, the fast tier does not
def test_two_fsdp2_ranks_update_exactly_like_one_process_on_the_whole_batch(model_dir, tmp_path):
    run_ranks(_dp_rank, 2, model_dir, str(tmp_path))
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for name, mbt, _, steps in DP_SCENARIOS:
        single = TorchEngine(model_dir, micro_batch_tokens=mbt, **EXACT)  # one row per micro-batch
        ranks = [torch.load(tmp_path / f"{name}_{r}.pt", weights_only=False) for r in range(2)]
        natural_counts = []
        for step, (seed, n0, n1) in enumerate(steps):
            seqs, data, shards = _dp_step_data(seed, n0, n1)
            ref = single.train_step(seqs, data, ppo_loss_fn)
            natural = [len(ffd_allocate([len(p) + len(o) for p, o in seqs[lo:hi]], mbt)) for lo, hi in shards]
            natural_counts.append(natural)
            if step == 0:  # logprobs under FSDP2 at the initial weights: the HF forward's
                for r, (lo, hi) in enumerate(shards):
                    assert_all_close(ranks[r]["logprobs"][0], reference_logprobs(hf, seqs[lo:hi]), atol=1e-5)
            dp = [r["stats"][step] for r in ranks]
            # Every rank ran the larger of the natural counts, even when they differ.
            assert dp[0]["n_micro_batches"] == dp[1]["n_micro_batches"] == max(natural)
            for key in ("loss", "grad_norm", "n_tokens", "n_valid_tokens", "clipped_tokens",
                        "capped_tokens", "behav_weight_sum", "behav_weight_max"):
                assert dp[0][key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), (name, key)
                assert dp[1][key] == dp[0][key], (name, key)
        if name == "uneven_micro_batches":  # the case this scenario exists for
            assert all(n0 != n1 for n0, n1 in natural_counts), natural_counts
        assert_same_weights(ranks[0]["weights"], full_weights(single))
        assert_same_weights(ranks[1]["weights"], full_weights(single))
        for v in (1, 2):  # the weights for generation, as every rank saved them together
            saved = load_file(tmp_path / f"{name}_weights_v{v}" / "model.safetensors")
            assert saved.keys() == ranks[0]["weights"].keys()
            assert all(torch.equal(saved[k], ranks[0]["weights"][k]) for k in saved), (name, v)
        # Stopping, loading into a fresh engine and going on is identical to not stopping.
        for r in ranks:
            assert r["resumed"].keys() == r["continued"].keys()
            assert all(torch.equal(r["resumed"][k], r["continued"][k]) for k in r["continued"]), name


# ---------------------------------------------------------------- save

def test_save_hf_round_trips_through_from_pretrained(model_dir, tmp_path):
    engine = TorchEngine(model_dir, optim=OptimSpec(lr=1e-2))
    seqs = make_seqs(4, 4)
    engine.train_step(seqs, {}, neg_mean_logprob)  # so that the saved weights are not the initial ones
    path = tmp_path / "ckpt"
    engine.save_hf(str(path), tokenizer=tiny_tokenizer())

    loaded = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.from_numpy(np.concatenate([np.concatenate(s) for s in seqs]))[None]
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, engine.model(ids).logits, atol=0, rtol=0)
        initial = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        assert not torch.equal(initial(ids).logits, loaded(ids).logits)
    # (AutoTokenizer would pick Qwen2Tokenizer from config.json's model_type and split digits.)
    assert transformers.PreTrainedTokenizerFast.from_pretrained(path)("3 7 12")["input_ids"] == [3, 7, 12]
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temporary directory left behind


def test_a_failed_save_leaves_no_partial_directory_and_keeps_the_old_one(model_dir, tmp_path, monkeypatch):
    engine = TorchEngine(model_dir, optim=OptimSpec(lr=1e-2))
    path = tmp_path / "weights"

    def half_written(directory, *args, **kwargs):
        with open(os.path.join(directory, "config.json"), "w") as f:
            f.write("{")
        raise OSError("disk full")

    monkeypatch.setattr(engine.model, "save_pretrained", half_written)
    with pytest.raises(OSError, match="disk full"):
        engine.save_weights(str(path))  # the first save goes through save_pretrained
    assert os.listdir(tmp_path) == []

    monkeypatch.undo()
    engine.save_weights(str(path))
    before = {f: (path / f).read_bytes() for f in os.listdir(path)}
    engine.train_step(make_seqs(5, 3), {}, neg_mean_logprob)

    def half_written_file(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\0" * 8)
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", half_written_file)  # the later saves write directly
    with pytest.raises(OSError, match="disk full"):
        engine.save_weights(str(path))
    assert os.listdir(tmp_path) == ["weights"]
    assert {f: (path / f).read_bytes() for f in os.listdir(path)} == before

    monkeypatch.undo()
    engine.save_weights(str(path))  # overwriting works, and publishes the new weights
    assert (path / "model.safetensors").read_bytes() != before["model.safetensors"]
    assert os.listdir(tmp_path) == ["weights"]


@pytest.mark.parametrize("tied", [False, True])
def test_later_weight_saves_write_the_files_save_pretrained_writes_without_calling_it(tmp_path, monkeypatch, tied):
    model_dir = save_tiny_qwen2(tmp_path / "start", tie_word_embeddings=tied)
    engine = TorchEngine(model_dir, optim=OptimSpec(lr=1e-2))
    engine.save_weights(str(tmp_path / "v1"))
    engine.train_step(make_seqs(4, 4), {}, neg_mean_logprob)
    engine.save_hf(str(tmp_path / "reference"))  # save_pretrained's own directory of the new weights

    def refused(*args, **kwargs):
        raise AssertionError("save_pretrained called")

    monkeypatch.setattr(engine.model, "save_pretrained", refused)
    engine.save_weights(str(tmp_path / "v2"))
    got, want = tmp_path / "v2", tmp_path / "reference"
    assert sorted(os.listdir(got)) == sorted(os.listdir(want)) == ["config.json", "generation_config.json",
                                                                   "model.safetensors"]
    for name in ("config.json", "generation_config.json"):
        assert (got / name).read_bytes() == (want / name).read_bytes()
    with safe_open(got / "model.safetensors", "pt") as g, safe_open(want / "model.safetensors", "pt") as w:
        assert g.metadata() == w.metadata()
        assert sorted(g.keys()) == sorted(w.keys())
        assert ("lm_head.weight" in g.keys()) is not tied  # a tied head is saved once, as the embedding
        assert all(torch.equal(g.get_tensor(k), w.get_tensor(k)) for k in w.keys())
    old, new = (load_file(tmp_path / v / "model.safetensors") for v in ("v1", "v2"))
    assert any(not torch.equal(old[k], new[k]) for k in new)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(got, dtype=torch.float32)
    ids = torch.arange(10)[None]
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, engine.model(ids).logits, atol=0, rtol=0)


def test_a_model_whose_tensors_save_pretrained_renames_keeps_save_pretrained(tmp_path):
    """transformers saves Mixtral's fused experts under their original checkpoint names: writing
    the parameters directly would write another checkpoint, so no layout is taken from it."""
    config = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=2,
                                        num_experts_per_tok=1, max_position_embeddings=64)
    mixtral = transformers.AutoModelForCausalLM.from_config(config)
    mixtral.save_pretrained(tmp_path / "mixtral")
    assert saved_layout(str(tmp_path / "mixtral"), [n for n, _ in mixtral.named_parameters()]) is None
    qwen = transformers.AutoModelForCausalLM.from_pretrained(save_tiny_qwen2(tmp_path / "qwen"))
    names = [n for n, _ in qwen.named_parameters()]
    assert sorted(saved_layout(str(tmp_path / "qwen"), names).files) == ["config.json", "generation_config.json"]
    qwen.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")  # several files and an index
    assert len([f for f in os.listdir(tmp_path / "sharded") if f.endswith(".safetensors")]) > 1
    assert saved_layout(str(tmp_path / "sharded"), names) is None


def test_a_sequence_mean_counts_sequences_in_the_denominator_and_survives_micro_batching(model_dir):
    """Token weights 1/len and shares 1/len (loss_agg seq-mean-token-mean): the loss function gets
    the number of sequences as its denominator, and splitting into micro-batches changes nothing."""
    seqs = make_seqs(4, 10)
    data = make_token_data(seqs, 4)
    data["token_weights"], data[LOSS_SHARE_KEY] = aggregation(
        [np.ones(len(o), dtype=bool) for _, o in seqs], AlgorithmConfig(loss_agg="seq-mean-token-mean"))
    seen = []

    def seq_mean_loss(logprobs, batch, mask, denominator):
        seen.append(denominator)
        return decoupled_ppo_loss(logprobs, batch["prox_logprobs"].float(), batch["behav_logprobs"].float(),
                                  batch["advantages"].float(), mask, eps_clip=0.2,
                                  token_weights=batch["token_weights"], n_valid_tokens=denominator)

    few = TorchEngine(model_dir, micro_batch_tokens=10_000, **EXACT)
    many = TorchEngine(model_dir, micro_batch_tokens=20, **EXACT)
    s_few, s_many = few.train_step(seqs, data, seq_mean_loss), many.train_step(seqs, data, seq_mean_loss)
    assert s_many["n_micro_batches"] > 3
    assert seen and all(d == pytest.approx(10.0) for d in seen)  # ten sequences, not their tokens
    assert s_many["loss"] == pytest.approx(s_few["loss"], rel=1e-5)
    assert_same_weights(full_weights(few), full_weights(many))


def test_a_value_head_starts_at_zero_learns_its_returns_and_round_trips(model_dir, tmp_path):
    """head="value": the actor's backbone with a fresh value head (0 everywhere at first). The value
    of output token j is the head at the position before it, as a whole-sequence forward gives it;
    the clipped value loss moves it toward the returns, and a saved critic loads with its head."""
    from areal_flow.algorithms.critic import value_loss

    seqs = make_seqs(5, 6)
    critic = TorchEngine(model_dir, optim=OptimSpec(lr=1e-2), head="value", micro_batch_tokens=40)
    assert all(np.array_equal(v, np.zeros(len(o), np.float32)) for v, (_, o) in zip(critic.logprobs(seqs), seqs))
    returns = [np.ones(len(o), np.float32) for _, o in seqs]

    def loss_fn(values, batch, mask, denominator):
        return value_loss(values, batch["values"], batch["returns"], mask, value_clip=None, n_valid_tokens=denominator)

    losses = []
    for _ in range(3):
        data = {"values": critic.logprobs(seqs), "returns": returns}
        losses.append(critic.train_step(seqs, data, loss_fn)["loss"])
    assert losses[0] == pytest.approx(0.5) and losses[2] < losses[1] < losses[0]
    values = critic.logprobs(seqs)
    prompt, output = seqs[0]
    with torch.no_grad():
        full = critic.model(input_ids=torch.tensor([np.concatenate([prompt, output])])).logits[0, :, 0]
    assert np.allclose(values[0], full[len(prompt) - 1:len(prompt) - 1 + len(output)].numpy(), atol=1e-5)
    critic.save(str(tmp_path / "critic"))
    again = TorchEngine(str(tmp_path / "critic"), head="value")
    assert_all_close(again.logprobs(seqs), values, atol=1e-6)
    with pytest.raises(ValueError, match="head must be one of lm, value"):
        TorchEngine(model_dir, head="policy")


# ---------------------------------------------------------------- skipping answers without a gradient

def _with_zero_advantages(seqs, seed):
    """PPO inputs where every third answer has advantages exactly 0 (a group of equal rewards)."""
    data = make_token_data(seqs, seed)
    data["advantages"] = [np.zeros(len(a)) if i % 3 == 0 else a for i, a in enumerate(data["advantages"])]
    return data, [i % 3 == 0 for i in range(len(seqs))]


def test_skipping_answers_whose_advantages_are_zero_changes_neither_the_update_nor_the_loss(model_dir):
    seqs = make_seqs(21, 12)
    data, skip = _with_zero_advantages(seqs, 21)
    full, skipping = (TorchEngine(model_dir, micro_batch_tokens=40, **EXACT) for _ in range(2))
    ref = full.train_step(seqs, data, ppo_loss_fn)
    got = skipping.train_step(seqs, data, ppo_loss_fn, skip=skip)
    assert_same_weights(full_weights(skipping), full_weights(full))
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    # Counted as before (the denominator holds them), but not run.
    assert (got["n_valid_tokens"], got["n_tokens"]) == (ref["n_valid_tokens"], ref["n_tokens"])
    assert got["skipped_tokens"] == sum(len(o) for (_, o), s in zip(seqs, skip) if s) > 0
    assert ref["skipped_tokens"] == 0
    assert got["n_micro_batches"] < ref["n_micro_batches"]


def test_skipping_answers_that_carry_a_gradient_would_change_the_update(model_dir):
    """The check above can fail: skipping the same answers with their advantages not zeroed moves
    the weights elsewhere."""
    seqs = make_seqs(21, 12)
    data = make_token_data(seqs, 21)
    _, skip = _with_zero_advantages(seqs, 21)
    full, skipping = (TorchEngine(model_dir, micro_batch_tokens=40, **EXACT) for _ in range(2))
    full.train_step(seqs, data, ppo_loss_fn)
    skipping.train_step(seqs, data, ppo_loss_fn, skip=skip)
    with pytest.raises(AssertionError):
        assert_same_weights(full_weights(skipping), full_weights(full))


def test_skip_flags_must_match_the_sequences(model_dir):
    seqs = make_seqs(22, 4)
    engine = TorchEngine(model_dir, **EXACT)
    with pytest.raises(ValueError, match="skip has 3 flags for 4 sequences"):
        engine.train_step(seqs, make_token_data(seqs, 22), ppo_loss_fn, skip=[True, False, False])


def _skip_rank(rank, model_dir, out_dir):
    seqs = make_seqs(23, 10)
    data, skip = _with_zero_advantages(seqs, 23)
    skip = [True] * 4 + skip[4:]  # rank 0's share is all skipped: it runs idle passes only
    for i in range(4):
        data["advantages"][i] = np.zeros(len(seqs[i][1]))
    lo, hi = (0, 4) if rank == 0 else (4, 10)
    engine = TorchEngine(model_dir, micro_batch_tokens=40, process_group=dist.group.WORLD, **EXACT)
    stats = engine.train_step(seqs[lo:hi], {k: v[lo:hi] for k, v in data.items()}, ppo_loss_fn, skip=skip[lo:hi])
    torch.save({"weights": full_weights(engine), "stats": stats}, os.path.join(out_dir, f"skip_{rank}.pt"))


@pytest.mark.slow  # processes of its own: the full suite runs it, the fast tier does not
def test_two_fsdp2_ranks_skipping_answers_update_like_one_process_running_them_all(model_dir, tmp_path):
    run_ranks(_skip_rank, 2, model_dir, str(tmp_path))
    seqs = make_seqs(23, 10)
    data, _ = _with_zero_advantages(seqs, 23)
    for i in range(4):
        data["advantages"][i] = np.zeros(len(seqs[i][1]))
    single = TorchEngine(model_dir, micro_batch_tokens=40, **EXACT)
    ref = single.train_step(seqs, data, ppo_loss_fn)
    for r in range(2):
        got = torch.load(tmp_path / f"skip_{r}.pt", weights_only=False)
        assert_same_weights(got["weights"], full_weights(single))
        assert got["stats"]["n_valid_tokens"] == ref["n_valid_tokens"]
        assert got["stats"]["loss"] == pytest.approx(ref["loss"], rel=1e-5)
