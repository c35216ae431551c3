"""AReaL's objective is every preset's default: at the start of a step, where π_θ = π_prox, it clips
no token, however stale, through a real engine's train step on the trainer's own path (the
library's objective, worker.train_update); naive PPO's clip against π_behav (clip_behav) would."""

import dataclasses
from functools import partial

import numpy as np
import pytest
from engine_helpers import make_seqs, save_tiny_qwen2
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from areal_flow.algorithms import library
from areal_flow.algorithms.diagnostics import MISMATCH, STALENESS_BUCKETS
from areal_flow.algorithms.prox import prox_source
from areal_flow.config.schema import AlgorithmConfig
from areal_flow.launch import CONF_DIR
from areal_flow.training.engine import LOSS_SHARE_KEY, OptimSpec
from areal_flow.training.torch_engine import TorchEngine
from areal_flow.training.updates import train_update

PRESETS = ("grpo", "ppo", "gspo", "dapo", "dr_grpo", "rloo", "reinforce_pp", "cispo")
TOKEN_LEVEL_PPO = ("grpo", "ppo", "dapo", "dr_grpo", "rloo", "reinforce_pp")
VERSION = 10  # the trainer's version: tokens were sampled 0 to 8 versions before it (η = 8)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"))


def preset(name: str):
    """The algorithm section as a user's `algorithm=NAME` resolves it (the launcher's composition)."""
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        raw = compose("config", overrides=[f"algorithm={name}"])
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(AlgorithmConfig), raw.algorithm))


def stale_batch(engine: TorchEngine, algo, seed: int):
    """16 answers in 4 groups: π_prox from the engine itself, behaviour logprobs 0.3 nats off it
    and 0-8 versions old, nonzero advantages; the aggregation's weights as the trainer adds them."""
    rng = np.random.default_rng(seed)
    seqs = [(p, o if len(o) else np.array([1])) for p, o in make_seqs(seed, 16)]
    prox = engine.logprobs(seqs)
    data = {"prox_logprobs": prox,
            "behav_logprobs": [(p + 0.3 * rng.standard_normal(len(p))).astype(np.float32) for p in prox],
            "advantages": [np.full(len(o), rng.choice([-1.5, -0.5, 0.5, 1.5]), dtype=np.float32) for _, o in seqs],
            "versions": [VERSION - rng.integers(0, 9, len(o)) for _, o in seqs],
            "seq_ids": [np.full(len(o), i, dtype=np.int64) for i, (_, o) in enumerate(seqs)]}
    if algo.loss_agg != "token-mean":
        data["token_weights"], data[LOSS_SHARE_KEY] = library.aggregation([np.ones(len(o), bool) for _, o in seqs], algo)
    return seqs, [i // 4 for i in range(16)], data


def first_step_stats(model_dir: str, algo, seed: int) -> dict[str, float]:
    """The stats of a step's first optimizer step, as the worker runs it: π_prox where the worker
    takes it from (the prox node's output, or the trained logprobs when the update is one step)."""
    engine = TorchEngine(model_dir, optim=OptimSpec(), micro_batch_tokens=64)
    seqs, groups, data = stale_batch(engine, algo, seed)
    source = prox_source(algo, reads_prox=True, all_current=False)
    loss_fn = partial(library.objective, algo=algo, prox_source=source, prox_version=VERSION, kl_coef=0.0)
    if algo.n_minibatches * algo.ppo_epochs == 1:
        return train_update(engine, groups, seqs, data, loss_fn, algo, first_loss_fn=partial(loss_fn, at_start=True))
    first = [i for i, g in enumerate(groups) if g < 4 // algo.n_minibatches]  # worker.minibatches' first split
    return engine.train_step([seqs[i] for i in first], {k: [v[i] for i in first] for k, v in data.items()},
                             partial(loss_fn, at_start=True))


def stale_tokens(stats: dict[str, float]) -> float:
    return sum(stats[MISMATCH.format(b, "tokens")] for b in STALENESS_BUCKETS[1:])


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("n_minibatches", [1, 2])
def test_no_token_is_clipped_at_the_start_of_a_step_under_any_presets_default(model_dir, name, n_minibatches):
    algo = dataclasses.replace(preset(name), n_minibatches=n_minibatches)
    assert (algo.correction, algo.clip_behav, algo.decoupled) == ("areal", False, True)
    stats = first_step_stats(model_dir, algo, seed=n_minibatches)
    assert stats["n_valid_tokens"] > 20 and stale_tokens(stats) > 0.7 * stats["n_valid_tokens"]
    assert stats["clipped_tokens"] == 0 and stats["dual_clipped_tokens"] == 0
    # The stale tokens are 0.3 nats off: the mismatch figures see it, the behaviour weight corrects it.
    assert 0.15 < stats[MISMATCH.format("5-8", "abs_sum")] / stats[MISMATCH.format("5-8", "tokens")] < 0.4


@pytest.mark.parametrize("name", TOKEN_LEVEL_PPO)
def test_naive_ppos_clip_against_behav_would_stop_stale_tokens_there(model_dir, name):
    algo = dataclasses.replace(preset(name), clip_behav=True)
    stats = first_step_stats(model_dir, algo, seed=1)
    assert stats["clipped_tokens"] > 0.1 * stats["n_valid_tokens"]
