"""The training half of a critic on a mesh of its own (training/critic.py): it trains once every
trainer rank's share of a step is in, exactly as on the whole batch at once, and its checkpoint part
resumes it exactly."""

import numpy as np
import pytest
import torch
from engine_helpers import make_seqs, save_tiny_qwen2
from hydra import compose, initialize_config_dir

from areal_flow.graph import graph_from_config
from areal_flow.launch import CONF_DIR
from areal_flow.runtime.spec import RunSpec, typed
from areal_flow.training.build import optim_spec
from areal_flow.training.critic import CRITIC_DIR, CriticTrainer
from areal_flow.training.torch_engine import TorchEngine
from areal_flow.transport.messages import Array, CriticBatch, SaveCheckpoint

pytestmark = pytest.mark.slow  # 3-4 s of engines; tests/training/test_inference_worker.py imports the module in the fast tier

CRITIC = [
    '+graph.critic_values={type: inference, role: critic, inputs: [prompt_ids, output_ids], outputs: [values], '
    'mesh: "2"}',
    '+graph.critic_train={type: train, role: critic, inputs: [prompt_ids, output_ids, behav_logprobs, values, '
    'rewards], mesh: "2", micro_batch_tokens: 64}',
    "graph.actor_train.inputs=[prompt_ids,output_ids,behav_logprobs,versions,prox_logprobs,rewards,values]",
]


def run_config():
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        # Two minibatches: the split goes by whole groups over every rank's share together.
        return typed(compose("config", overrides=["output_dir=/tmp/unused", "cluster.n_devices=3",
                                                  "algorithm.n_minibatches=2", "algorithm.critic_lr=1e-2", *CRITIC]))


def spec(tmp_path, model, n_trainers, resume=""):
    return RunSpec(run_dir=str(tmp_path), model_path=model, train_path="", eval_path="", gen_ports=[],
                   controller_port=0, rollout_ports=[], trainer_ports=[0] * n_trainers, dist_port=0,
                   n_trainers=n_trainers, n_rollout=1, resume=resume)


def share(step, rank, groups, seqs, returns):
    """A trainer rank's CriticBatch: groups of two samples, the values a fresh head gives (0)."""
    return CriticBatch(step, rank, [g for g in groups for _ in range(2)], [Array.of(p) for p, _ in seqs],
                       [Array.of(o) for _, o in seqs],
                       {"values": [Array.of(np.zeros(len(o), np.float32)) for _, o in seqs],
                        "returns": [Array.of(r) for r in returns]})


def trainer(cfg, tmp_path, model, n_trainers, resume="", values=None):
    engine = TorchEngine(model, optim=optim_spec(cfg, "critic"), head="value")
    node = graph_from_config(cfg).critic_apart
    return CriticTrainer(cfg, spec(tmp_path, model, n_trainers, resume), engine, node, "critic_values_infer0", values)


def weights(engine):
    return {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


def test_it_trains_once_every_rank_has_sent_its_share_as_on_the_whole_batch_and_resumes_exactly(tmp_path):
    cfg = run_config()
    assert graph_from_config(cfg).critic_apart.name == "critic_train"
    model = save_tiny_qwen2(tmp_path / "model")
    seqs = make_seqs(3, 8)
    rng = np.random.default_rng(0)
    returns = [rng.normal(size=len(o)).astype(np.float32) for _, o in seqs]
    two = trainer(cfg, tmp_path, model, n_trainers=2)
    # Rank 1's share comes first; a second copy of it is dropped; rank 0's completes the step.
    assert two.batch(share(0, 1, [2, 3], seqs[4:], returns[4:])) is None
    assert two.batch(share(0, 1, [2, 3], seqs[4:], returns[4:])) is None
    assert not any(p.grad is not None and p.grad.abs().sum() > 0 for p in two.engine.model.parameters())
    done = two.batch(share(0, 0, [0, 1], seqs[:4], returns[:4]))
    assert done is not None and done.step == 0 and done.version == 1 and two.engine.version == 1
    assert done.stats["n_valid_tokens"] == sum(len(o) for _, o in seqs) and done.stats["loss"] > 0
    assert two.pending == {}
    # The same batch from one rank, in rank order: the same two optimizer steps, the same weights.
    one = trainer(cfg, tmp_path, model, n_trainers=1)
    before = weights(one.engine)
    again = one.batch(share(0, 0, [0, 1, 2, 3], seqs, returns))
    assert again.stats["loss"] == done.stats["loss"]
    after = weights(two.engine)
    assert any(not torch.equal(before[k], after[k]) for k in after)
    assert all(torch.equal(after[k], v) for k, v in weights(one.engine).items())

    # Its checkpoint part, and a critic resumed from it: the same weights, version and optimizer
    # (the next step trains both alike).
    saved = two.save(SaveCheckpoint(str(tmp_path / "ckpt"), groups=[]))
    assert saved.path == str(tmp_path / "ckpt") and (tmp_path / "ckpt" / CRITIC_DIR).is_dir()
    resumed = trainer(cfg, tmp_path, model, n_trainers=2, resume=str(tmp_path / "ckpt"))
    assert resumed.engine.version == 1
    assert all(torch.equal(v, after[k]) for k, v in weights(resumed.engine).items())
    for t in (two, resumed):
        t.batch(share(1, 0, [4, 5], seqs[:4], returns[:4]))
        t.batch(share(1, 1, [], [], []))  # a rank with nothing of its own this step
    assert resumed.engine.version == two.engine.version == 2
    assert all(torch.equal(v, weights(two.engine)[k]) for k, v in weights(resumed.engine).items())
    # The end of a run: the Hugging Face export, which loads as a value head.
    two.save(SaveCheckpoint(str(tmp_path / "final"), groups=None))
    exported = TorchEngine(str(tmp_path / "final" / CRITIC_DIR), head="value")
    assert np.allclose(exported.logprobs(seqs[:2])[0], two.engine.logprobs(seqs[:2])[0], atol=1e-6)


def test_a_value_copy_follows_the_trained_critic_after_each_update(tmp_path):
    """On several devices values come from a whole copy of the critic (its weights are sharded for
    training): after each update, and after a resume, it answers as the trained critic would."""
    cfg = run_config()
    model = save_tiny_qwen2(tmp_path / "model")
    seqs = make_seqs(4, 4)
    returns = [np.full(len(o), 2.0, np.float32) for _, o in seqs]
    copy = TorchEngine(model, head="value")
    critic = trainer(cfg, tmp_path, model, n_trainers=1, values=copy)
    assert critic.values is copy and critic.engine is not copy
    critic.batch(share(0, 0, [0, 1], seqs, returns))
    trained = critic.engine.logprobs(seqs)
    assert any(np.abs(v).max() > 0 for v in trained)  # the head moved off 0
    assert all(np.array_equal(a, b) for a, b in zip(copy.logprobs(seqs), trained)) and copy.version == 1
    critic.save(SaveCheckpoint(str(tmp_path / "ckpt"), groups=[]))
    resumed = trainer(cfg, tmp_path, model, n_trainers=1, resume=str(tmp_path / "ckpt"),
                      values=TorchEngine(model, head="value"))
    assert all(np.array_equal(a, b) for a, b in zip(resumed.values.logprobs(seqs), trained))
