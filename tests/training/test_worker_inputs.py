import numpy as np
import pytest

from areal_flow.config.schema import AlgorithmConfig, NormConfig, RunConfig
from areal_flow.graph import build_graph
from areal_flow.training.engine import LOSS_MASK_KEY, LOSS_SHARE_KEY
from areal_flow.training.worker import minibatches, optim_spec, ppo_inputs, prox_source
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
    seqs, data = ppo_inputs(samples, graph, graph.nodes["train"], algo())
    adv = [a.tolist() for a in data["advantages"]]
    assert [len(a) for a in adv] == [3, 5, 2, 4]  # one value per output token
    assert adv[0][0] > 0 > adv[1][0] and adv[0][0] == pytest.approx(-adv[1][0])  # centred within group 0
    assert adv[2] == [0.0, 0.0] and adv[3] == [0.0] * 4  # group 1 all right: no signal
    assert [len(o) for _, o in seqs] == [3, 5, 2, 4]


def test_prox_and_ref_logprobs_are_told_apart_by_the_meaning_their_writer_declares():
    graph = build_graph(NODES, ["prompt", "answer"], 2, ["arith"])
    _, data = ppo_inputs([sample(0, 0, 3, 1.0), sample(0, 1, 3, 0.0)], graph, graph.nodes["train"], algo())
    assert data["prox_logprobs"][0][0] == pytest.approx(-1.1)
    assert data["ref_logprobs"][0][0] == pytest.approx(-1.2)
    assert data["behav_logprobs"][0][0] == pytest.approx(-1.0)


def test_without_a_prox_node_the_train_node_gets_no_prox_logprobs():
    nodes = {k: v for k, v in NODES.items() if k != "prox"}
    nodes["train"] = {**NODES["train"], "inputs": ["prompt_ids", "output_ids", "behav_logprobs", "lp_ref", "score"]}
    graph = build_graph(nodes, ["prompt", "answer"], 2, ["arith"])
    _, data = ppo_inputs([sample(0, 0, 3, 1.0), sample(0, 1, 3, 0.0)], graph, graph.nodes["train"], algo())
    assert "prox_logprobs" not in data and "ref_logprobs" in data


def test_truncated_answers_get_a_zero_loss_mask_only_when_asked():
    graph = build_graph(NODES, ["prompt", "answer"], 2, ["arith"])
    samples = [sample(0, 0, 3, 1.0), sample(0, 1, 4, 0.0, Finish.LENGTH)]
    _, data = ppo_inputs(samples, graph, graph.nodes["train"], algo(mask_truncated=True))
    assert [m.tolist() for m in data[LOSS_MASK_KEY]] == [[True] * 3, [False] * 4]
    _, data = ppo_inputs(samples, graph, graph.nodes["train"], algo())
    assert LOSS_MASK_KEY not in data


def test_minibatches_split_by_whole_groups_and_repeat_per_epoch():
    group_ids = [3, 3, 1, 1, 2, 2, 5, 5]  # as samples arrive, not sorted
    one = minibatches(group_ids, n_minibatches=2, epochs=1)
    assert one == [[2, 3, 4, 5], [0, 1, 6, 7]]  # groups {1, 2} then {3, 5}: whole groups, each sample once
    assert minibatches(group_ids, n_minibatches=2, epochs=3) == one * 3
    assert minibatches(group_ids, n_minibatches=1, epochs=2) == [list(range(8))] * 2
    # More minibatches than groups: the extra ones are empty (the engine still joins the collectives).
    assert minibatches([0, 0], n_minibatches=2, epochs=1) == [[0, 1], []]


def test_the_lr_schedule_spans_every_optimizer_step_of_the_run():
    cfg = RunConfig(total_steps=10, algorithm=algo(n_minibatches=2, ppo_epochs=3, lr_schedule="linear"))
    assert optim_spec(cfg).decay_steps == 60


def with_versions(s: Sample, version: int) -> Sample:
    s.arrays["a_ver"] = Array.of(np.full(len(s.array("output_ids")), version, dtype=np.int32))
    return s


VERSIONED = {**NODES, "generate": {**NODES["generate"], "outputs": ["prompt_ids", "output_ids", "behav_logprobs", "a_ver"],
                                   "keys": {"versions": "a_ver"}},
             "train": {**NODES["train"], "inputs": NODES["train"]["inputs"] + ["a_ver"]}}


def test_prox_comes_without_a_forward_pass_only_where_that_is_exact():
    graph = build_graph(VERSIONED, ["prompt", "answer"], 2, ["arith"])
    train = graph.nodes["train"]
    # One optimizer step: the trained logprobs are π_prox, whatever the tokens' versions.
    assert prox_source(graph, train, algo(), all_current=False) == "current"
    two_steps = algo(n_minibatches=2)
    assert prox_source(graph, train, two_steps, all_current=True) == "behav"  # all sampled by π_prox
    assert prox_source(graph, train, two_steps, all_current=False) == "data"  # needs the prox node
    assert prox_source(graph, train, algo(ppo_epochs=2, prox_logp="loglinear"), False) == "loglinear"
    assert prox_source(graph, train, algo(prox_shortcut=False), True) == "data"
    assert prox_source(graph, train, algo(decoupled=False), False) is None  # naive PPO


def test_the_prox_node_output_is_passed_on_only_when_the_step_uses_it():
    graph = build_graph(VERSIONED, ["prompt", "answer"], 2, ["arith"])
    samples = [with_versions(sample(0, 0, 3, 1.0), 2), with_versions(sample(0, 1, 2, 0.0), 2)]
    _, data = ppo_inputs(samples, graph, graph.nodes["train"], algo(), prox_source="current")
    assert "prox_logprobs" not in data and [v.tolist() for v in data["versions"]] == [[2, 2, 2], [2, 2]]
    assert [s.tolist() for s in data["seq_ids"]] == [[0, 0, 0], [1, 1]]


def test_rloo_advantages_and_a_sequence_mean_reach_the_token_data():
    graph = build_graph(NODES, ["prompt", "answer"], 2, ["arith"])
    rloo = algo(group_size=4, loss_agg="seq-mean-token-mean",
                reward_norm=NormConfig(mean_level="group", std_level="none", leave_one_out=True))
    samples = [sample(0, i, n, r) for i, (n, r) in enumerate([(1, 1.0), (2, 0.0), (3, 0.0), (4, 1.0)])]
    _, data = ppo_inputs(samples, graph, graph.nodes["train"], rloo)
    # r_i − mean of the other three answers: 1 − 1/3 and 0 − 2/3, on every token.
    assert [a.tolist() for a in data["advantages"]] == [pytest.approx([2 / 3] * 1), pytest.approx([-2 / 3] * 2),
                                                        pytest.approx([-2 / 3] * 3), pytest.approx([2 / 3] * 4)]
    assert [w.tolist() for w in data["token_weights"]] == [pytest.approx([1 / n] * n) for n in (1, 2, 3, 4)]
    assert sum(float(s.sum()) for s in data[LOSS_SHARE_KEY]) == pytest.approx(4.0)  # the denominator counts answers


def test_the_overlong_penalty_and_kl_as_a_reward_change_the_advantages():
    graph = build_graph(NODES, ["prompt", "answer"], 2, ["arith"])
    plain = algo(reward_norm=NormConfig(mean_level="none", std_level="none"), max_new_tokens=8)
    samples = [sample(0, 0, 4, 1.0), sample(0, 1, 8, 1.0)]
    _, data = ppo_inputs(samples, graph, graph.nodes["train"], plain)
    assert data["advantages"][1].tolist() == pytest.approx([1.0] * 8)
    # The last 4 tokens before the limit of 8: the 8-token answer loses the whole factor 0.5.
    shaped = algo(reward_norm=NormConfig(mean_level="none", std_level="none"), max_new_tokens=8, overlong_tokens=4,
                  overlong_penalty_factor=0.5)
    _, data = ppo_inputs(samples, graph, graph.nodes["train"], shaped)
    assert data["advantages"][0].tolist() == pytest.approx([1.0] * 4)
    assert data["advantages"][1].tolist() == pytest.approx([0.5] * 8)
    # KL as a reward: behav − ref = 0.2 per token (k1), so each token's return loses β·0.2 per token after it.
    kl = algo(reward_norm=NormConfig(mean_level="none", std_level="none"), kl_in="reward", kl_estimator="k1")
    _, data = ppo_inputs(samples, graph, graph.nodes["train"], kl, kl_coef=0.5)
    assert data["advantages"][0].tolist() == pytest.approx([1 - 0.1 * k for k in (4, 3, 2, 1)])


def test_batch_normalised_advantages_agree_across_ranks():
    """Two ranks with half the batch each, their statistics summed as the process group would,
    normalise exactly like one rank with the whole batch."""
    graph = build_graph(NODES, ["prompt", "answer"], 2, ["arith"])
    batch = algo(reward_norm=NormConfig(mean_level="none", std_level="none"),
                 adv_norm=NormConfig(mean_level="batch", std_level="batch"))
    samples = [sample(0, 0, 3, 1.0), sample(0, 1, 5, 0.0), sample(1, 0, 2, 1.0), sample(1, 1, 4, 0.5)]
    _, whole = ppo_inputs(samples, graph, graph.nodes["train"], batch)
    halves = [samples[:2], samples[2:]]
    sums = []  # what each rank passes to the all-reduce

    def record(t):
        sums.append(t)
        return t

    for half in halves:
        ppo_inputs(half, graph, graph.nodes["train"], batch, all_reduce=record)
    total = sums[0] + sums[1]
    parts = [ppo_inputs(half, graph, graph.nodes["train"], batch, all_reduce=lambda t: total)[1] for half in halves]
    got = [a.tolist() for p in parts for a in p["advantages"]]
    assert got == [pytest.approx(a.tolist(), abs=1e-6) for a in whole["advantages"]]
    # A rank without samples still joins the all-reduce (or the others would wait for it forever).
    joined = []
    _, empty = ppo_inputs([], graph, graph.nodes["train"], batch, all_reduce=lambda t: joined.append(t) or t)
    assert joined and empty["advantages"] == []


