"""`loss_mask` from the samples to the weights: the train node's inputs (algorithms/inputs.py) and
one torch-engine step with the train node's objective (algorithms/library.py), as a trainer rank
runs them. Observation tokens (mask 0: what a tool or an environment wrote into a multi-turn answer)
are context for the tokens after them and nothing else; a one-turn answer with its mask all ones
trains bit for bit as an answer without one."""

from functools import partial

import numpy as np
import pytest
import torch
from engine_helpers import EXACT, VOCAB, full_weights, save_tiny_qwen2

from areal_flow.algorithms import library
from areal_flow.algorithms.inputs import train_inputs
from areal_flow.config.schema import AlgorithmConfig, NormConfig
from areal_flow.graph import build_graph
from areal_flow.training.torch_engine import TorchEngine
from areal_flow.training.updates import engine_data
from areal_flow.transport.messages import Array, Finish, Sample

PER_TOKEN = ("behav_logprobs", "lp_prox", "lp_ref")


def graph(with_mask: bool):
    mask = ["loss_mask"] if with_mask else []
    nodes = {
        "generate": {"type": "generate", "role": "actor", "inputs": ["prompt"], "mesh": "0",
                     "outputs": ["prompt_ids", "output_ids", "behav_logprobs", *mask]},
        "reward": {"type": "reward", "fn": "arith", "inputs": ["output_ids", "answer"], "outputs": ["score"]},
        "prox": {"type": "inference", "role": "actor", "inputs": ["prompt_ids", "output_ids"], "outputs": ["lp_prox"],
                 "keys": {"prox_logprobs": "lp_prox"}, "mesh": "1"},
        "ref": {"type": "inference", "role": "ref", "inputs": ["prompt_ids", "output_ids"], "outputs": ["lp_ref"],
                "keys": {"ref_logprobs": "lp_ref"}, "mesh": "1"},
        "train": {"type": "train", "role": "actor", "mesh": "1",
                  "inputs": ["prompt_ids", "output_ids", "behav_logprobs", "lp_prox", "lp_ref", "score", *mask]},
    }
    return build_graph(nodes, ["prompt", "answer"], 4, ["arith"])


def answers(seed: int, observations: bool) -> list[Sample]:
    """One group of 4 answers of 14 tokens; with `observations`, tokens 4-7 of every other answer
    are a tool's output (mask 0)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(4):
        n = 14
        lp = lambda: np.log(1 / VOCAB) + 0.3 * rng.standard_normal(n).astype(np.float32)  # noqa: E731
        mask = np.ones(n, dtype=np.uint8)
        if observations and i % 2:
            mask[4:8] = 0
        arrays = {"prompt_ids": rng.integers(0, VOCAB, 5).astype(np.int32),
                  "output_ids": rng.integers(0, VOCAB, n).astype(np.int32), "loss_mask": mask,
                  **{k: lp().astype(np.float32) for k in PER_TOKEN}}
        out.append(Sample(uid=f"a{i}", prompt_id="p", group_id=0, index=i, birth_time=0.0,
                          arrays={k: Array.of(v) for k, v in arrays.items()}, scalars={"score": float(i % 3 == 0)},
                          finish=Finish.STOP))
    return out


def with_garbage_on_observations(samples: list[Sample]) -> list[Sample]:
    """The same answers, every per-token input replaced by nonsense where the mask is 0."""
    changed = []
    for s in samples:
        obs = s.array("loss_mask") == 0
        arrays = dict(s.arrays)
        for k in PER_TOKEN:
            arrays[k] = Array.of(np.where(obs, np.float32(-30.0), s.array(k)).astype(np.float32))
        changed.append(Sample(uid=s.uid, prompt_id=s.prompt_id, group_id=s.group_id, index=s.index, birth_time=0.0,
                              arrays=arrays, scalars=s.scalars, finish=s.finish))
    return changed


CONFIGS = {
    "GRPO, KL in the loss, seq-mean-token-mean": dict(kl_in="loss", loss_agg="seq-mean-token-mean"),
    "KL as a reward, token-mean": dict(kl_in="reward"),
}


def step(model_dir: str, samples: list[Sample], with_mask: bool, algo: AlgorithmConfig):
    """One train step as a trainer rank runs it: (its inputs, its stats but timings, the weights after it)."""
    inputs = train_inputs(samples, partial(graph(with_mask).input, graph(with_mask).nodes["train"]), algo,
                          kl_coef=0.1)
    engine = TorchEngine(model_dir, entropy=True, micro_batch_tokens=40, **EXACT)
    loss_fn = partial(library.objective, algo=algo, prox_source="data", prox_version=0, kl_coef=0.1)
    stats = engine.train_step(inputs.seqs, engine_data(inputs), loss_fn)
    return inputs, {k: v for k, v in stats.items() if not k.endswith("_seconds")}, full_weights(engine)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"))


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("config", CONFIGS)
def test_a_one_turn_answer_with_its_mask_all_ones_trains_bit_for_bit_as_one_without(model_dir, config):
    algo = AlgorithmConfig(group_size=4, kl_coef=0.1, **CONFIGS[config])
    samples = answers(1, observations=False)
    _, plain, plain_weights = step(model_dir, samples, False, algo)
    inputs, masked, masked_weights = step(model_dir, samples, True, algo)
    assert inputs.loss_mask is not None and all(m.all() for m in inputs.loss_mask)
    assert same_bits(masked_weights, plain_weights)
    assert masked == plain  # every stat, to the bit


@pytest.mark.parametrize("config", CONFIGS)
def test_observation_tokens_add_exactly_nothing_to_the_update(model_dir, config):
    algo = AlgorithmConfig(group_size=4, kl_coef=0.1, **CONFIGS[config])
    samples = answers(2, observations=True)
    inputs, stats, weights = step(model_dir, samples, True, algo)
    # No advantage, weight or share on an observation; the policy's tokens alone are counted.
    policy = [s.array("loss_mask") != 0 for s in samples]
    assert [m.tolist() for m in inputs.loss_mask] == [p.tolist() for p in policy]
    for a, p in zip(inputs.advantages, policy):
        assert not a[~p].any() and a[p].any()
    assert stats["n_valid_tokens"] == sum(int(p.sum()) for p in policy) == 4 * 14 - 2 * 4
    # Whatever an observation's behaviour, proximal or reference logprobs say, the update and
    # every stat (loss, KL, entropy, clip counts) are the same to the bit.
    _, garbage_stats, garbage_weights = step(model_dir, with_garbage_on_observations(samples), True, algo)
    assert same_bits(garbage_weights, weights)
    assert garbage_stats == stats
    # The check can fail: the same nonsense on tokens the loss counts moves the weights.
    _, _, unmasked = step(model_dir, with_garbage_on_observations(samples), False, algo)
    assert not same_bits(unmasked, weights)


def test_gae_runs_over_the_policys_tokens_as_if_the_observations_were_absent():
    keys = {"prompt_ids": "p", "output_ids": "o", "behav_logprobs": "b", "rewards": "r", "values": "v",
            "loss_mask": "m"}
    n = 6
    values = np.array([0.1, 0.2, 9.0, 9.0, 0.3, 0.4], dtype=np.float32)  # tokens 2-3: an observation
    arrays = {"p": np.array([1, 2], dtype=np.int32), "o": np.arange(n, dtype=np.int32),
              "b": np.full(n, -0.5, dtype=np.float32), "v": values, "m": np.array([1, 1, 0, 0, 1, 1], dtype=np.uint8)}
    sample = Sample(uid="a", prompt_id="p", group_id=0, index=0, birth_time=0.0,
                    arrays={k: Array.of(v) for k, v in arrays.items()}, scalars={"r": 1.0}, finish=Finish.STOP)
    algo = AlgorithmConfig(group_size=1, adv_estimator="gae", gamma=1.0, gae_lambda=1.0,
                           reward_norm=NormConfig(mean_level="none", std_level="none"),
                           adv_norm=NormConfig(mean_level="none", std_level="none"))
    got = train_inputs([sample], keys.get, algo)
    # γ = λ = 1: A_t = R − V_t on the policy's tokens, the critic's targets R there; 0 on the
    # observation, whose values (9.0) reach nothing.
    assert got.advantages[0].tolist() == pytest.approx([0.9, 0.8, 0.0, 0.0, 0.7, 0.6])
    assert got.token_data["returns"][0].tolist() == pytest.approx([1.0, 1.0, 0.0, 0.0, 1.0, 1.0])
    assert got.loss_mask[0].tolist() == [True, True, False, False, True, True]  # the critic's loss too
