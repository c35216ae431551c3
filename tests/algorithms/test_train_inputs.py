"""The train node's loss inputs (algorithms/inputs.py) and where π_prox comes from (algorithms/prox.py)."""

import dataclasses
from functools import partial

import numpy as np
import pytest

from areal_flow.algorithms.inputs import TrainInputs, train_inputs
from areal_flow.algorithms.prox import prox_source
from areal_flow.config.schema import AlgorithmConfig, NormConfig
from areal_flow.graph import build_graph
from areal_flow.graph.dag import Graph
from areal_flow.transport.messages import Array, Finish, Sample

NODES = {
    "generate": {"type": "generate", "role": "actor", "inputs": ["prompt"],
                 "outputs": ["prompt_ids", "output_ids", "behav_logprobs", "versions"], "mesh": "0"},
    "reward": {"type": "reward", "fn": "arith", "inputs": ["output_ids", "answer"], "outputs": ["score"]},
    "prox": {"type": "inference", "role": "actor", "inputs": ["prompt_ids", "output_ids"], "outputs": ["lp_prox"],
             "keys": {"prox_logprobs": "lp_prox"}, "mesh": "1"},
    "ref": {"type": "inference", "role": "ref", "inputs": ["prompt_ids", "output_ids"], "outputs": ["lp_ref"],
            "keys": {"ref_logprobs": "lp_ref"}, "mesh": "1"},
    "train": {"type": "train", "role": "actor", "mesh": "1",
              "inputs": ["prompt_ids", "output_ids", "behav_logprobs", "lp_prox", "lp_ref", "score"]},
}


def algo(**changes) -> AlgorithmConfig:
    return AlgorithmConfig(**{"group_size": 2, **changes})


def inputs_of(samples: list[Sample], graph: Graph, algo: AlgorithmConfig, **kwargs) -> TrainInputs:
    """The train node's inputs, its keys resolved by the graph as the trainer does."""
    return train_inputs(samples, partial(graph.input, graph.nodes["train"]), algo, **kwargs)


def sample(group: int, index: int, n_out: int, reward: float, finish: Finish = Finish.STOP) -> Sample:
    out = np.arange(n_out, dtype=np.int32)
    lp = lambda shift: Array.of(np.full(n_out, -1.0 - shift, dtype=np.float32))  # noqa: E731
    return Sample(uid=f"g{group}-{index}", prompt_id="p", group_id=group, index=index, birth_time=0.0,
                  arrays={"prompt_ids": Array.of(np.array([5, 6], dtype=np.int32)), "output_ids": Array.of(out),
                          "behav_logprobs": lp(0.0), "lp_prox": lp(0.1), "lp_ref": lp(0.2)},
                  scalars={"score": reward}, finish=finish)


def test_advantages_are_normalised_per_group_and_cover_every_answer_token():
    graph = build_graph(NODES, ["prompt", "answer"], 2, ["arith"])
    samples = [sample(0, 0, 3, 1.0), sample(0, 1, 5, 0.0), sample(1, 0, 2, 1.0), sample(1, 1, 4, 1.0)]
    got = inputs_of(samples, graph, algo())
    seqs, data = got.seqs, got.token_data
    adv = [a.tolist() for a in data["advantages"]]
    assert [len(a) for a in adv] == [3, 5, 2, 4]  # one value per output token
    assert adv[0][0] > 0 > adv[1][0] and adv[0][0] == pytest.approx(-adv[1][0])  # centred within group 0
    assert adv[2] == [0.0, 0.0] and adv[3] == [0.0] * 4  # group 1 all right: no signal
    assert [len(o) for _, o in seqs] == [3, 5, 2, 4]


def test_an_agent_s_roles_are_normalised_apart_within_their_group():
    graph = build_graph(NODES, ["prompt", "answer"], 2, ["arith"])
    # One group of 4: two rollouts' solver samples, then their checker samples (run_group's order).
    samples = [sample(0, 0, 2, 1.0), sample(0, 1, 2, 0.0), sample(0, 2, 2, 5.0), sample(0, 3, 2, 5.0)]
    apart = [a[0] for a in inputs_of(samples, graph, algo(group_size=4), roles=2).token_data["advantages"]]
    assert apart[0] > 0 > apart[1] and apart[0] == pytest.approx(-apart[1])  # the solvers, among themselves
    assert apart[2:] == [0.0, 0.0]  # the checkers agreed: no signal for them, whatever the solvers got
    together = [a[0] for a in inputs_of(samples, graph, algo(group_size=4)).token_data["advantages"]]
    assert together[2] > 0 and together[0] < 0  # one block would have the checkers beat every solver


def test_prox_and_ref_logprobs_are_told_apart_by_the_meaning_their_writer_declares():
    graph = build_graph(NODES, ["prompt", "answer"], 2, ["arith"])
    data = inputs_of([sample(0, 0, 3, 1.0), sample(0, 1, 3, 0.0)], graph, algo()).token_data
    assert data["prox_logprobs"][0][0] == pytest.approx(-1.1)
    assert data["ref_logprobs"][0][0] == pytest.approx(-1.2)
    assert data["behav_logprobs"][0][0] == pytest.approx(-1.0)


def test_without_a_prox_node_the_train_node_gets_no_prox_logprobs():
    nodes = {k: v for k, v in NODES.items() if k != "prox"}
    nodes["train"] = {**NODES["train"], "inputs": ["prompt_ids", "output_ids", "behav_logprobs", "lp_ref", "score"]}
    graph = build_graph(nodes, ["prompt", "answer"], 2, ["arith"])
    data = inputs_of([sample(0, 0, 3, 1.0), sample(0, 1, 3, 0.0)], graph, algo()).token_data
    assert "prox_logprobs" not in data and "ref_logprobs" in data


def test_truncated_answers_get_a_zero_loss_mask_only_when_asked():
    graph = build_graph(NODES, ["prompt", "answer"], 2, ["arith"])
    samples = [sample(0, 0, 3, 1.0), sample(0, 1, 4, 0.0, Finish.LENGTH)]
    masked = inputs_of(samples, graph, algo(mask_truncated=True))
    assert [m.tolist() for m in masked.loss_mask] == [[True] * 3, [False] * 4]
    assert masked.valid_masks() is masked.loss_mask
    plain = inputs_of(samples, graph, algo())
    assert plain.loss_mask is None
    assert [m.tolist() for m in plain.valid_masks()] == [[True] * 3, [True] * 4]


def with_versions(s: Sample, version: int) -> Sample:
    s.arrays["a_ver"] = Array.of(np.full(len(s.array("output_ids")), version, dtype=np.int32))
    return s


VERSIONED = {**NODES, "generate": {**NODES["generate"], "outputs": ["prompt_ids", "output_ids", "behav_logprobs", "a_ver"],
                                   "keys": {"versions": "a_ver"}},
             "train": {**NODES["train"], "inputs": NODES["train"]["inputs"] + ["a_ver"]}}


def test_prox_comes_without_a_forward_pass_only_where_that_is_exact():
    # One optimizer step: the trained logprobs are π_prox, whatever the tokens' versions.
    assert prox_source(algo(), reads_prox=True, all_current=False) == "current"
    two_steps = algo(n_minibatches=2)
    assert prox_source(two_steps, reads_prox=True, all_current=True) == "behav"  # all sampled by π_prox
    assert prox_source(two_steps, reads_prox=True, all_current=False) == "data"  # needs the prox node
    assert prox_source(algo(ppo_epochs=2, prox_logp="loglinear"), reads_prox=True, all_current=False) == "loglinear"
    assert prox_source(algo(prox_shortcut=False), reads_prox=True, all_current=True) == "data"
    assert prox_source(algo(decoupled=False), reads_prox=True, all_current=False) is None  # naive PPO
    assert prox_source(two_steps, reads_prox=False, all_current=False) is None  # no prox node: naive PPO
    # training.zero_mismatch: the prox node's forward every step, though a shortcut would be exact.
    assert prox_source(algo(), reads_prox=True, all_current=True, exact=True) == "data"
    assert prox_source(two_steps, reads_prox=True, all_current=True, exact=True) == "data"
    assert prox_source(algo(decoupled=False), reads_prox=True, all_current=True, exact=True) is None


def test_the_prox_node_output_is_passed_on_only_when_the_step_uses_it():
    graph = build_graph(VERSIONED, ["prompt", "answer"], 2, ["arith"])
    samples = [with_versions(sample(0, 0, 3, 1.0), 2), with_versions(sample(0, 1, 2, 0.0), 2)]
    data = inputs_of(samples, graph, algo(), prox_source="current").token_data
    assert "prox_logprobs" not in data and [v.tolist() for v in data["versions"]] == [[2, 2, 2], [2, 2]]
    assert [s.tolist() for s in data["seq_ids"]] == [[0, 0, 0], [1, 1]]


def test_rloo_advantages_and_a_sequence_mean_reach_the_token_data():
    graph = build_graph(NODES, ["prompt", "answer"], 2, ["arith"])
    rloo = algo(group_size=4, loss_agg="seq-mean-token-mean",
                reward_norm=NormConfig(mean_level="group", std_level="none", leave_one_out=True))
    samples = [sample(0, i, n, r) for i, (n, r) in enumerate([(1, 1.0), (2, 0.0), (3, 0.0), (4, 1.0)])]
    got = inputs_of(samples, graph, rloo)
    data = got.token_data
    # r_i − mean of the other three answers: 1 − 1/3 and 0 − 2/3, on every token.
    assert [a.tolist() for a in data["advantages"]] == [pytest.approx([2 / 3] * 1), pytest.approx([-2 / 3] * 2),
                                                        pytest.approx([-2 / 3] * 3), pytest.approx([2 / 3] * 4)]
    assert [w.tolist() for w in data["token_weights"]] == [pytest.approx([1 / n] * n) for n in (1, 2, 3, 4)]
    assert sum(float(s.sum()) for s in got.loss_share) == pytest.approx(4.0)  # the denominator counts answers


def test_the_overlong_penalty_and_kl_as_a_reward_change_the_advantages():
    graph = build_graph(NODES, ["prompt", "answer"], 2, ["arith"])
    plain = algo(reward_norm=NormConfig(mean_level="none", std_level="none"), max_new_tokens=8)
    samples = [sample(0, 0, 4, 1.0), sample(0, 1, 8, 1.0)]
    data = inputs_of(samples, graph, plain).token_data
    assert data["advantages"][1].tolist() == pytest.approx([1.0] * 8)
    # The last 4 tokens before the limit of 8: the 8-token answer loses the whole factor 0.5.
    shaped = algo(reward_norm=NormConfig(mean_level="none", std_level="none"), max_new_tokens=8, overlong_tokens=4,
                  overlong_penalty_factor=0.5)
    data = inputs_of(samples, graph, shaped).token_data
    assert data["advantages"][0].tolist() == pytest.approx([1.0] * 4)
    assert data["advantages"][1].tolist() == pytest.approx([0.5] * 8)
    # KL as a reward: behav − ref = 0.2 per token (k1), so each token's return loses β·0.2 per token after it.
    kl = algo(reward_norm=NormConfig(mean_level="none", std_level="none"), kl_in="reward", kl_estimator="k1")
    data = inputs_of(samples, graph, kl, kl_coef=0.5).token_data
    assert data["advantages"][0].tolist() == pytest.approx([1 - 0.1 * k for k in (4, 3, 2, 1)])


def test_batch_normalised_advantages_agree_across_ranks():
    """Two ranks with half the batch each, their statistics summed as the process group would,
    normalise exactly like one rank with the whole batch."""
    graph = build_graph(NODES, ["prompt", "answer"], 2, ["arith"])
    batch = algo(reward_norm=NormConfig(mean_level="none", std_level="none"),
                 adv_norm=NormConfig(mean_level="batch", std_level="batch"))
    samples = [sample(0, 0, 3, 1.0), sample(0, 1, 5, 0.0), sample(1, 0, 2, 1.0), sample(1, 1, 4, 0.5)]
    whole = inputs_of(samples, graph, batch).token_data
    halves = [samples[:2], samples[2:]]
    sums = []  # what each rank passes to the all-reduce

    def record(t):
        sums.append(t)
        return t

    for half in halves:
        inputs_of(half, graph, batch, all_reduce=record)
    total = sums[0] + sums[1]
    parts = [inputs_of(half, graph, batch, all_reduce=lambda t: total).token_data for half in halves]
    got = [a.tolist() for p in parts for a in p["advantages"]]
    assert got == [pytest.approx(a.tolist(), abs=1e-6) for a in whole["advantages"]]
    # A rank without samples still joins the all-reduce (or the others would wait for it forever).
    joined = []
    empty = inputs_of([], graph, batch, all_reduce=lambda t: joined.append(t) or t).token_data
    assert joined and empty["advantages"] == []




def test_train_inputs_hold_the_sequences_per_token_data_and_the_engines_mask_and_shares():
    """A hand-built batch, its keys named by a plain mapping (no graph): every field the trainer reads."""
    keys = {"prompt_ids": "p", "output_ids": "o", "behav_logprobs": "b", "rewards": "r", "values": "v",
            "versions": "ver"}

    def answer(index: int, out: list[int], reward: float, finish: Finish) -> Sample:
        n = len(out)
        arrays = {"p": np.array([1, 2], dtype=np.int32), "o": np.array(out, dtype=np.int32),
                  "b": np.full(n, -0.5, dtype=np.float32), "v": np.linspace(0.0, 0.5, n, dtype=np.float32),
                  "ver": np.full(n, 3, dtype=np.int32)}
        return Sample(uid=f"a{index}", prompt_id="p", group_id=0, index=index, birth_time=0.0,
                      arrays={k: Array.of(v) for k, v in arrays.items()}, scalars={"r": reward}, finish=finish)

    samples = [answer(0, [7, 8, 9], 1.0, Finish.STOP), answer(1, [4, 5], 0.0, Finish.LENGTH)]
    cfg = algo(reward_norm=NormConfig(mean_level="none", std_level="none"), loss_agg="seq-mean-token-mean",
               mask_truncated=True)
    got = train_inputs(samples, keys.get, cfg)
    assert [(p.tolist(), o.tolist()) for p, o in got.seqs] == [([1, 2], [7, 8, 9]), ([1, 2], [4, 5])]
    # No prox_logprobs key: none is passed on, even with prox_source 'data'.
    assert list(got.token_data) == ["behav_logprobs", "versions", "values", "advantages", "returns", "seq_ids",
                                    "token_weights"]
    # GAE with γ = λ = 1: A_t = reward − V_t, and the critic's targets A + V are the reward; the
    # truncated answer's masked tokens get 0.
    assert [a.tolist() for a in got.advantages] == [pytest.approx([1.0, 0.75, 0.5]), [0.0, 0.0]]
    assert got.token_data["returns"][0].tolist() == pytest.approx([1.0] * 3)
    assert [s.tolist() for s in got.token_data["seq_ids"]] == [[0, 0, 0], [1, 1]]
    assert [v.tolist() for v in got.token_data["versions"]] == [[3, 3, 3], [3, 3]]
    # The truncated answer has no valid token: weight and share 0, so the denominator counts one answer.
    assert [m.tolist() for m in got.loss_mask] == [[True] * 3, [False] * 2]
    assert [w.tolist() for w in got.token_data["token_weights"]] == [pytest.approx([1 / 3] * 3), [0.0, 0.0]]
    assert [s.tolist() for s in got.loss_share] == [pytest.approx([1 / 3] * 3), [0.0, 0.0]]
    # The critic's view: a token mean, the rest unchanged; the policy's inputs are left as they were.
    critic = got.without_aggregation()
    assert critic.loss_share is None and "token_weights" not in critic.token_data
    assert critic.loss_mask is got.loss_mask and critic.seqs is got.seqs
    assert "token_weights" in got.token_data and got.loss_share is not None
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.loss_mask = None
