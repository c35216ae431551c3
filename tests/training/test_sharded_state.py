"""Resumable checkpoints written sharded with torch.distributed.checkpoint (`save_resumable`,
`load_resumable`): exact resumes, resharding onto another number of ranks, no rank holding the
whole optimizer state, and megatron's per-rank state refused on another layout."""

import os

import pytest
import torch
import torch.distributed as dist
from engine_helpers import (EXACT, full_weights, make_seqs, make_token_data, ppo_loss_fn, run_ranks, save_tiny_qwen2,
                            tiny_tokenizer)

from areal_flow.training.checkpoint_files import RANK_RNG, RESUMABLE_META, SHARDED_STATE, TRAIN_STATE
from areal_flow.training.engine import CheckpointError
from areal_flow.training.torch_engine import TorchEngine

MBT = 32


@pytest.fixture
def model_dir(tmp_path):
    return save_tiny_qwen2(tmp_path / "model")


def _step(seed):
    seqs = make_seqs(seed, 6)
    return seqs, make_token_data(seqs, seed), ppo_loss_fn


def _shard(step, rank, world):
    seqs, data, loss = step
    lo, hi = (0, len(seqs)) if world == 1 else [(0, 4), (4, len(seqs))][rank]  # uneven on purpose
    return seqs[lo:hi], {k: v[lo:hi] for k, v in data.items()}, loss


def _full_optimizer_state(engine) -> dict[str, dict[str, torch.Tensor]]:
    """Every parameter's whole AdamW state by Hugging Face name (collective under FSDP; rank 0 gets it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    sharded = engine._group is not None
    state = get_optimizer_state_dict(engine.model, engine._optimizer,
                                     options=StateDictOptions(full_state_dict=True, cpu_offload=sharded))
    return {name: {k: v.clone() for k, v in s.items()} for name, s in state.get("state", {}).items()}


def _assert_same_state(got, want):
    assert got.keys() == want.keys() and got
    for name in want:
        assert got[name].keys() == {"step", "exp_avg", "exp_avg_sq"} == want[name].keys(), name
        for key in want[name]:
            assert torch.equal(got[name][key], want[name][key]), (name, key)


def test_one_rank_round_trip_is_exact_and_writes_the_layout(model_dir, tmp_path):
    engine = TorchEngine(model_dir, micro_batch_tokens=MBT, **EXACT)
    engine.train_step(*_step(1))
    engine.version, engine.extra_state = 3, {"kl": {"coef": 0.25}}
    ckpt = str(tmp_path / "ckpt")
    engine.save_resumable(ckpt, tokenizer=tiny_tokenizer())
    rng = torch.get_rng_state()
    saved_state = _full_optimizer_state(engine)
    engine.train_step(*_step(2))
    continued = full_weights(engine)

    files = {os.path.relpath(os.path.join(root, f), ckpt) for root, _, fs in os.walk(ckpt) for f in fs}
    assert {"config.json", "model.safetensors", "tokenizer.json", RESUMABLE_META, RANK_RNG.format(rank=0),
            f"{SHARDED_STATE}/.metadata", f"{SHARDED_STATE}/__0_0.distcp"} <= files
    assert TRAIN_STATE not in files  # nothing gathered into one file

    torch.manual_seed(99)  # the load puts the saved RNG back
    resumed = TorchEngine(ckpt, micro_batch_tokens=MBT, **EXACT)  # the servers' Hugging Face weights
    resumed.load_resumable(ckpt)
    assert torch.equal(torch.get_rng_state(), rng)
    assert (resumed.version, resumed.extra_state) == (3, {"kl": {"coef": 0.25}})
    _assert_same_state(_full_optimizer_state(resumed), saved_state)
    resumed.train_step(*_step(2))
    assert all(torch.equal(w, continued[k]) for k, w in full_weights(resumed).items())


def test_a_checkpoint_that_does_not_fit_is_refused_naming_the_file_and_changes_nothing(model_dir, tmp_path):
    engine = TorchEngine(model_dir, micro_batch_tokens=MBT, **EXACT)
    engine.train_step(*_step(1))
    ckpt = str(tmp_path / "ckpt")
    engine.save_resumable(ckpt)
    other = TorchEngine(save_tiny_qwen2(tmp_path / "wider", hidden_size=48), micro_batch_tokens=MBT, **EXACT)
    before = full_weights(other)
    with pytest.raises(CheckpointError, match=r"dcp: tensor model\.model\.embed_tokens\.weight has shape \[18, 32\], "
                                              r"this model wants \[18, 48\]"):
        other.load_resumable(ckpt)
    assert all(torch.equal(w, before[k]) for k, w in full_weights(other).items())
    engine.save(str(tmp_path / "full"))  # the end-of-run export: no sharded state
    with pytest.raises(CheckpointError, match=r"meta\.pt: missing"):
        engine.load_resumable(str(tmp_path / "full"))
    os.remove(os.path.join(ckpt, SHARDED_STATE, ".metadata"))
    with pytest.raises(CheckpointError, match=r"dcp: no \.metadata"):
        engine.load_resumable(ckpt)


# ---------------------------------------------------------------- two FSDP2 ranks


def _save_two_ranks(rank, model_dir, out_dir):
    engine = TorchEngine(model_dir, micro_batch_tokens=MBT, process_group=dist.group.WORLD, **EXACT)
    engine.train_step(*_shard(_step(1), rank, 2))
    engine.version, engine.extra_state = 4, {"kl": {"coef": 0.5}}
    ckpt = os.path.join(out_dir, "ckpt2")
    engine.save_resumable(ckpt, tokenizer=tiny_tokenizer())
    saved = {"rng": torch.get_rng_state(), "weights": full_weights(engine), "state": _full_optimizer_state(engine)}
    engine.train_step(*_shard(_step(2), rank, 2))
    saved["continued"] = full_weights(engine)
    torch.save(saved, os.path.join(out_dir, f"saved{rank}.pt"))


def _load_two_ranks(rank, out_dir):
    saved = torch.load(os.path.join(out_dir, f"saved{rank}.pt"))
    reference = torch.load(os.path.join(out_dir, "saved0.pt"))  # rank 0 gathered the whole state
    ckpt = os.path.join(out_dir, "ckpt2")
    torch.manual_seed(1000 + rank)
    resumed = TorchEngine(ckpt, micro_batch_tokens=MBT, process_group=dist.group.WORLD, **EXACT)
    resumed.load_resumable(ckpt)
    assert torch.equal(torch.get_rng_state(), saved["rng"])  # this rank's own, same number of ranks
    assert (resumed.version, resumed.extra_state) == (4, {"kl": {"coef": 0.5}})
    resumed.train_step(*_shard(_step(2), rank, 2))
    torch.save(full_weights(resumed), os.path.join(out_dir, f"resumed{rank}.pt"))
    # 1 -> 2: the checkpoint the single process wrote, resharded onto two ranks.
    from_one = TorchEngine(ckpt, micro_batch_tokens=MBT, process_group=dist.group.WORLD, **EXACT)
    from_one.load_resumable(os.path.join(out_dir, "ckpt1"))
    weights, state = full_weights(from_one), _full_optimizer_state(from_one)
    assert all(torch.equal(w, reference["weights"][k]) for k, w in weights.items())
    if rank == 0:
        _assert_same_state(state, reference["state"])
    open(os.path.join(out_dir, f"loaded{rank}.ok"), "w").close()


@pytest.mark.slow  # processes of its own: the full suite runs it, the fast tier does not
def test_two_fsdp2_ranks_write_their_own_shards_and_resume_exactly_at_two_ranks_or_one(model_dir, tmp_path):
    run_ranks(_save_two_ranks, 2, model_dir, str(tmp_path))
    ckpt = tmp_path / "ckpt2"
    saved = [torch.load(tmp_path / f"saved{r}.pt") for r in range(2)]

    # Each rank wrote its own half of the model and optimizer state: none gathered the whole.
    shards = {f.name: f.stat().st_size for f in (ckpt / SHARDED_STATE).iterdir() if f.suffix == ".distcp"}
    assert shards.keys() == {"__0_0.distcp", "__1_0.distcp"}, shards
    assert all(0.35 < size / sum(shards.values()) < 0.65 for size in shards.values()), shards
    assert (ckpt / RANK_RNG.format(rank=1)).exists() and not (ckpt / TRAIN_STATE).exists()

    # 2 -> 1: one process reads both ranks' shards and has the saved weights and AdamW state exactly.
    rng = torch.get_rng_state()
    single = TorchEngine(str(ckpt), micro_batch_tokens=MBT, **EXACT)
    single.load_resumable(str(ckpt))
    assert torch.equal(torch.get_rng_state(), rng)  # another number of ranks: no rank's RNG is this one's
    assert (single.version, single.extra_state) == (4, {"kl": {"coef": 0.5}})
    assert all(torch.equal(w, saved[0]["weights"][k]) for k, w in full_weights(single).items())
    _assert_same_state(_full_optimizer_state(single), saved[0]["state"])
    single.save_resumable(str(tmp_path / "ckpt1"))  # for 1 -> 2 below

    # A fresh pair of ranks loads it and takes the next step exactly as the pair that never stopped.
    run_ranks(_load_two_ranks, 2, str(tmp_path))
    assert all((tmp_path / f"loaded{r}.ok").exists() for r in range(2))
    for r in range(2):
        resumed, continued = torch.load(tmp_path / f"resumed{r}.pt"), saved[r]["continued"]
        assert resumed.keys() == continued.keys()
        assert all(torch.equal(resumed[k], continued[k]) for k in continued)


# ---------------------------------------------------------------- megatron


def _megatron_round_trip(rank, model_dir, out_dir):
    from areal_flow.training.megatron.engine import MegatronEngine

    engine = MegatronEngine(model_dir, micro_batch_tokens=MBT, **EXACT)
    world = dist.get_world_size()
    engine.train_step(*_shard(_step(1), engine.dp_rank, world))
    engine.version, engine.extra_state = 6, {"kl": {"coef": 0.75}}
    ckpt = os.path.join(out_dir, "mckpt")
    engine.save_resumable(ckpt, tokenizer=tiny_tokenizer())
    rng = torch.get_rng_state()
    engine.train_step(*_shard(_step(2), engine.dp_rank, world))
    continued = full_weights(engine)

    torch.manual_seed(7)
    resumed = MegatronEngine(ckpt, micro_batch_tokens=MBT, **EXACT)
    resumed.load_resumable(ckpt)
    assert torch.equal(torch.get_rng_state(), rng)
    assert (resumed.version, resumed.extra_state, resumed._step) == (6, {"kl": {"coef": 0.75}}, 1)
    resumed.train_step(*_shard(_step(2), resumed.dp_rank, world))
    assert all(torch.equal(w, continued[k]) for k, w in full_weights(resumed).items())

    # Another layout's optimizer state is refused naming both layouts, and changes nothing.
    dist.barrier()
    if rank == 0:
        meta = torch.load(os.path.join(ckpt, RESUMABLE_META), weights_only=True)
        torch.save(meta | {"layout": "d1p1t2"}, os.path.join(ckpt, RESUMABLE_META))
    dist.barrier()
    before = full_weights(resumed)
    with pytest.raises(CheckpointError, match=rf"meta\.pt: saved by layout d1p1t2, this run is d{world}p1t1"):
        resumed.load_resumable(ckpt)
    assert all(torch.equal(w, before[k]) for k, w in full_weights(resumed).items())
    open(os.path.join(out_dir, f"megatron{rank}.ok"), "w").close()


@pytest.mark.slow  # processes of its own (megatron's parallel state is per process)
def test_megatron_writes_each_ranks_state_sharded_and_resumes_exactly_on_its_layout(model_dir, tmp_path):
    world = 2  # two data-parallel ranks: each writes its own shard (one rank is the same path, less)
    run_ranks(_megatron_round_trip, world, model_dir, str(tmp_path), timeout=240)
    assert all((tmp_path / f"megatron{r}.ok").exists() for r in range(world))
    shards = sorted(f.name for f in (tmp_path / "mckpt" / SHARDED_STATE).iterdir() if f.suffix == ".distcp")
    assert shards == [f"__{r}_0.distcp" for r in range(world)]
    assert not (tmp_path / "mckpt" / TRAIN_STATE).exists()
