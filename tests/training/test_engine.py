import datetime
import os
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers

from areal_flow.algorithms.packing import ffd_allocate
from areal_flow.algorithms.ppo import decoupled_ppo_loss
from areal_flow.training.engine import TorchEngine

VOCAB = 18


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_qwen2")
    transformers.Qwen2ForCausalLM(config).save_pretrained(path)
    return str(path)


def _seqs(seed: int, n: int, max_prompt: int = 8, max_output: int = 12):
    rng = np.random.default_rng(seed)
    lengths = [(rng.integers(1, max_prompt + 1), rng.integers(0, max_output + 1)) for _ in range(n)]
    return [(rng.integers(0, VOCAB, p), rng.integers(0, VOCAB, o)) for p, o in lengths]


def _token_data(seqs, seed: int) -> dict[str, list[np.ndarray]]:
    """PPO inputs near the tiny model's logprobs (about log 1/18): some ratios clip, some weights cap."""
    rng = np.random.default_rng(seed)
    prox = [np.log(1 / VOCAB) + 0.2 * rng.standard_normal(len(o)) for _, o in seqs]
    return {
        "prox_logprobs": prox,
        "behav_logprobs": [p + 0.4 * rng.standard_normal(len(p)) for p in prox],
        "advantages": [np.full(len(o), rng.choice([-1.0, 1.0])) for _, o in seqs],
    }


def ppo_loss_fn(logprobs, batch, mask, n_valid_tokens):
    return decoupled_ppo_loss(
        logprobs, batch["prox_logprobs"].float(), batch["behav_logprobs"].float(),
        batch["advantages"].float(), mask, eps_clip=0.2, behav_weight_cap=2.0, n_valid_tokens=n_valid_tokens,
    )


def neg_mean_logprob(logprobs, batch, mask, n_valid_tokens):
    loss = -(logprobs * mask).sum() / n_valid_tokens
    return loss, {"n_tokens": mask.sum().float()}


def _reference_logprobs(model, seqs, temperature=1.0):
    """One ordinary, unpacked HF forward per sequence."""
    out = []
    with torch.no_grad():
        for prompt, output in seqs:
            ids = torch.from_numpy(np.concatenate([prompt, output]))[None]
            logp = (model(ids).logits[0] / temperature).log_softmax(-1)
            pos = torch.arange(len(prompt) - 1, len(prompt) + len(output) - 1)
            out.append(logp[pos, torch.from_numpy(output)].numpy())
    return out


def _assert_all_close(xs, ys, atol):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        np.testing.assert_allclose(x, y, atol=atol, rtol=0)


# For |g| below Adam's eps the update is about lr·g/eps, so eps=1e-8 would blow float rounding
# differences in near-zero gradients (1e-12) up by lr/eps = 1e6. Comparisons of updated weights
# between packings or rank layouts therefore use a larger eps; it changes nothing else they check.
EXACT = dict(lr=1e-2, eps=1e-4)


def _weights(engine):
    return {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


def _assert_same_weights(a, b, atol=1e-6):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0, msg=k)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_a_full_sequence_hf_forward(model_dir, temperature):
    engine = TorchEngine(model_dir, temperature=temperature, micro_batch_tokens=40)
    seqs = _seqs(0, 12)
    got = engine.logprobs(seqs)
    assert [len(g) for g in got] == [len(o) for _, o in seqs]
    assert all(g.dtype == np.float32 for g in got)
    _assert_all_close(got, _reference_logprobs(engine.model, seqs, temperature), atol=1e-5)


def test_packed_logprobs_equal_unpacked(model_dir):
    seqs = _seqs(1, 10)
    one_row = TorchEngine(model_dir, micro_batch_tokens=10_000, trainable=False)
    one_per_seq = TorchEngine(model_dir, micro_batch_tokens=1, trainable=False)
    assert len(ffd_allocate([len(p) + len(o) for p, o in seqs], 10_000)) == 1  # really one packed row
    packed, unpacked = one_row.logprobs(seqs), one_per_seq.logprobs(seqs)
    _assert_all_close(packed, unpacked, atol=1e-5)

    # The comparison can fail: concatenating without restarting positions lets sequences see each other.
    ids = torch.from_numpy(np.concatenate([np.concatenate([p, o]) for p, o in seqs]))[None]
    with torch.no_grad():
        leaky = one_row.model(ids).logits[0].log_softmax(-1)
    p1, o1 = seqs[1]
    start = len(seqs[0][0]) + len(seqs[0][1]) + len(p1) - 1
    leaky_lp = leaky[torch.arange(start, start + len(o1)), torch.from_numpy(o1)].numpy()
    assert np.abs(leaky_lp - packed[1]).max() > 1e-3


def test_train_step_lowers_the_loss_and_reports_counts(model_dir):
    engine = TorchEngine(model_dir, lr=1e-2, micro_batch_tokens=30)
    seqs = _seqs(2, 8)
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
    seqs = _seqs(3, 10)
    data = _token_data(seqs, 3)
    few = TorchEngine(model_dir, micro_batch_tokens=10_000, **EXACT)
    many = TorchEngine(model_dir, micro_batch_tokens=20, **EXACT)
    s_few = few.train_step(seqs, data, ppo_loss_fn)
    s_many = many.train_step(seqs, data, ppo_loss_fn)
    assert s_few["n_micro_batches"] == 1 and s_many["n_micro_batches"] > 3
    assert s_few["clipped_tokens"] > 0 and s_few["capped_tokens"] > 0  # every branch of the loss is hit
    assert s_many["grad_norm"] == pytest.approx(s_few["grad_norm"], rel=1e-5)
    for key in ("loss", "clipped_tokens", "capped_tokens", "behav_weight_sum", "behav_weight_max"):
        assert s_many[key] == pytest.approx(s_few[key], rel=1e-5, abs=1e-7), key
    _assert_same_weights(_weights(few), _weights(many))


def test_token_data_that_does_not_match_the_outputs_is_rejected(model_dir):
    engine = TorchEngine(model_dir)
    seqs = [(np.array([1, 2]), np.array([3, 4, 5]))]
    with pytest.raises(ValueError, match=r"token_data\['advantages'\]\[0\] has 2 values for 3 output tokens"):
        engine.train_step(seqs, {"advantages": [np.zeros(2)]}, neg_mean_logprob)


# ---------------------------------------------------------------- data parallel

# (name, micro_batch_tokens, steps); each step is (seed, number of sequences on rank 0, on rank 1).
DP_SCENARIOS = [
    ("uneven_micro_batches", 24, [(10, 3, 5), (11, 4, 4)]),
    ("empty_rank", 24, [(12, 6, 0)]),
]


def _dp_step_data(seed, n0, n1):
    # Rank 0 gets long sequences, rank 1 short ones, so their natural micro-batch counts differ.
    long, short = _seqs(seed, n0, 10, 14), _seqs(seed + 100, n1, 2, 3)
    seqs = long + short
    return seqs, _token_data(seqs, seed), [(0, n0), (n0, n0 + n1)]


def _dp_worker(rank, world, port, model_dir, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        for name, mbt, steps in DP_SCENARIOS:
            engine = TorchEngine(model_dir, micro_batch_tokens=mbt, process_group=dist.group.WORLD, **EXACT)
            all_stats = []
            for seed, n0, n1 in steps:
                seqs, data, shards = _dp_step_data(seed, n0, n1)
                lo, hi = shards[rank]
                shard_data = {k: v[lo:hi] for k, v in data.items()}
                all_stats.append(engine.train_step(seqs[lo:hi], shard_data, ppo_loss_fn))
            result = {"weights": _weights(engine), "stats": all_stats}
            torch.save(result, os.path.join(out_dir, f"{name}_{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_gloo_ranks_update_exactly_like_one_process_on_the_whole_batch(model_dir, tmp_path):
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_dp_worker, args=(r, 2, port, model_dir, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0, 0]

    for name, mbt, steps in DP_SCENARIOS:
        single = TorchEngine(model_dir, micro_batch_tokens=mbt, **EXACT)
        ranks = [torch.load(tmp_path / f"{name}_{r}.pt") for r in range(2)]
        natural_counts = []
        for step, (seed, n0, n1) in enumerate(steps):
            seqs, data, shards = _dp_step_data(seed, n0, n1)
            ref = single.train_step(seqs, data, ppo_loss_fn)
            natural = [len(ffd_allocate([len(p) + len(o) for p, o in seqs[lo:hi]], mbt)) for lo, hi in shards]
            natural_counts.append(natural)
            dp = [r["stats"][step] for r in ranks]
            # Every rank ran the larger of the natural counts, even when they differ.
            assert dp[0]["n_micro_batches"] == dp[1]["n_micro_batches"] == max(natural)
            for key in ("loss", "grad_norm", "n_tokens", "n_valid_tokens", "clipped_tokens",
                        "capped_tokens", "behav_weight_sum", "behav_weight_max"):
                assert dp[0][key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), (name, key)
                assert dp[1][key] == dp[0][key], (name, key)
        if name == "uneven_micro_batches":  # the case this scenario exists for
            assert all(n0 != n1 for n0, n1 in natural_counts), natural_counts
        _assert_same_weights(ranks[0]["weights"], _weights(single))
        _assert_same_weights(ranks[1]["weights"], _weights(single))


# ---------------------------------------------------------------- save

def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{str(i): i for i in range(1, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


def test_save_hf_round_trips_through_from_pretrained(model_dir, tmp_path):
    engine = TorchEngine(model_dir, lr=1e-2)
    seqs = _seqs(4, 4)
    engine.train_step(seqs, {}, neg_mean_logprob)  # so that the saved weights are not the initial ones
    path = tmp_path / "ckpt"
    engine.save_hf(str(path), tokenizer=_tiny_tokenizer())

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
    engine = TorchEngine(model_dir, lr=1e-2)
    path = tmp_path / "weights"

    def half_written(directory, *args, **kwargs):
        with open(os.path.join(directory, "config.json"), "w") as f:
            f.write("{")
        raise OSError("disk full")

    real_save = engine.model.save_pretrained
    monkeypatch.setattr(engine.model, "save_pretrained", half_written)
    with pytest.raises(OSError, match="disk full"):
        engine.save_weights(str(path))
    assert os.listdir(tmp_path) == []

    monkeypatch.setattr(engine.model, "save_pretrained", real_save)
    engine.save_weights(str(path))
    before = {f: (path / f).read_bytes() for f in os.listdir(path)}
    engine.train_step(_seqs(5, 3), {}, neg_mean_logprob)
    monkeypatch.setattr(engine.model, "save_pretrained", half_written)
    with pytest.raises(OSError, match="disk full"):
        engine.save_weights(str(path))
    assert os.listdir(tmp_path) == ["weights"]
    assert {f: (path / f).read_bytes() for f in os.listdir(path)} == before

    monkeypatch.setattr(engine.model, "save_pretrained", real_save)
    engine.save_weights(str(path))  # overwriting works, and publishes the new weights
    assert (path / "model.safetensors").read_bytes() != before["model.safetensors"]
    assert os.listdir(tmp_path) == ["weights"]
