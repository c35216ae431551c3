"""The algorithm library as a recipe selects it: π_prox sources, KL as a loss term, and losses,
estimators and shapers named by registry name or import path."""

import math
import sys
import textwrap

import pytest
import torch

from areal_flow.algorithms import registry
from areal_flow.algorithms.library import objective, objective_terms, zero_gradient
from areal_flow.algorithms.ppo import decoupled_ppo_loss
from areal_flow.config.schema import AlgorithmConfig, NormConfig, RunConfig
from areal_flow.run.checks import algorithm_problems


def batch(seed=0, n=12):
    g = torch.Generator().manual_seed(seed)
    behav = -torch.rand(n, generator=g, dtype=torch.float64) * 2
    logp = (behav + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)).requires_grad_()
    data = {"behav_logprobs": behav, "advantages": torch.randn(n, generator=g, dtype=torch.float64),
            "ref_logprobs": behav - 0.1, "versions": torch.tensor([3] * (n // 2) + [1] * (n - n // 2)),
            "seq_ids": torch.arange(n) // 3}
    return logp, data, torch.ones(n, dtype=torch.bool)


def test_the_current_prox_source_is_the_trained_logprobs_detached():
    logp, data, mask = batch()
    algo = AlgorithmConfig(behav_weight_cap=math.inf)  # AReaL's objective, uncapped: every token weighted by w
    loss, stats = objective(logp, data, mask, 12.0, algo=algo, prox_source="current", prox_version=3, kl_coef=0.0)
    want, _ = decoupled_ppo_loss(logp, logp.detach().clone(), data["behav_logprobs"], data["advantages"], mask,
                                 eps_clip=0.2, n_valid_tokens=12.0)
    assert loss.item() == pytest.approx(want.item())
    assert stats["ratio_sum"].item() == pytest.approx(12.0)  # r = 1 on every token: nothing clipped
    (grad,) = torch.autograd.grad(loss, logp)
    w = torch.exp(logp.detach() - data["behav_logprobs"])
    assert torch.allclose(grad, -w * data["advantages"] / 12.0)


def test_behav_and_loglinear_prox_sources():
    logp, data, mask = batch(1)
    algo = AlgorithmConfig(behav_weight_cap=math.inf)
    behav, _ = objective(logp, data, mask, 12.0, algo=algo, prox_source="behav", prox_version=3, kl_coef=0.0)
    naive, _ = objective(logp, data, mask, 12.0, algo=algo, prox_source=None, prox_version=3, kl_coef=0.0)
    assert behav.item() == pytest.approx(naive.item())  # π_prox = π_behav: w = 1, r = π_θ/π_behav
    loglinear, stats = objective(logp, data, mask, 12.0, algo=algo, prox_source="loglinear", prox_version=3,
                                 kl_coef=0.0)
    # Tokens of version 3 (= π_prox's) get w = 1 exactly; the version-1 tokens do not.
    assert stats["behav_weight_sum"].item() != pytest.approx(12.0)
    prox = data["behav_logprobs"] + torch.cat([torch.zeros(6), torch.full((6,), 2 / 3)]).double() * (
        logp.detach() - data["behav_logprobs"])
    want, _ = decoupled_ppo_loss(logp, prox, data["behav_logprobs"], data["advantages"], mask, eps_clip=0.2,
                                 n_valid_tokens=12.0)
    assert loglinear.item() == pytest.approx(want.item())


def test_kl_as_a_loss_term_adds_beta_times_the_estimate():
    logp, data, mask = batch(2)
    algo = AlgorithmConfig(kl_estimator="k2", kl_in="loss")
    base, _ = objective(logp, data, mask, 12.0, algo=algo, prox_source=None, prox_version=0, kl_coef=0.0)
    with_kl, stats = objective(logp, data, mask, 12.0, algo=algo, prox_source=None, prox_version=0, kl_coef=0.3)
    k2 = ((logp.detach() - data["ref_logprobs"]) ** 2 / 2).sum()
    assert with_kl.item() == pytest.approx(base.item() + 0.3 * k2.item() / 12.0)
    assert stats["kl_sum"].item() == pytest.approx(k2.item())
    # As a reward it is not in the loss.
    reward, _ = objective(logp, data, mask, 12.0, algo=AlgorithmConfig(kl_in="reward"), prox_source=None,
                          prox_version=0, kl_coef=0.3)
    assert reward.item() == pytest.approx(base.item())


def test_builtin_names_are_the_registered_ones():
    for kind in registry.KINDS:
        assert registry.names(kind) == sorted(registry.BUILTINS[kind])


def test_a_function_of_your_own_is_named_by_its_import_path(tmp_path, monkeypatch):
    (tmp_path / "my_algos.py").write_text(textwrap.dedent("""
        import torch

        def half_pg(logprobs, prox, batch, mask, denominator, algo):
            loss = -(batch["advantages"] * logprobs * mask).sum() / denominator / 2
            return loss, {"n_tokens": mask.sum().detach().double()}

        def bonus(scores, lengths, truncated, algo):
            return scores + 1.0
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    logp, data, mask = batch(3)
    algo = AlgorithmConfig(policy_loss="my_algos:half_pg")
    loss, _ = objective(logp, data, mask, 12.0, algo=algo, prox_source=None, prox_version=0, kl_coef=0.0)
    assert loss.item() == pytest.approx(-(data["advantages"] * logp.detach()).sum().item() / 24.0)
    assert algorithm_problems(RunConfig(algorithm=AlgorithmConfig(policy_loss="my_algos:half_pg",
                                                                  reward_shapers=["my_algos:bonus"]))) == []
    sys.modules.pop("my_algos", None)


def test_a_registered_name_cannot_be_taken_twice():
    def mine(*args):
        return None

    with pytest.raises(ValueError, match="policy_loss 'ppo' is already registered"):
        registry.register("policy_loss", "ppo")(mine)
    with pytest.raises(ValueError, match="unknown registry 'losses'"):
        registry.register("losses", "x")


def test_bad_algorithm_settings_are_named_by_their_keys():
    algo = AlgorithmConfig(
        policy_loss="cispo", c_clip=3.0, adv_estimator="vtrace", reward_shapers=["no_such_module_xyz:f"],
        reward_norm=NormConfig(mean_level="batch", leave_one_out=True), behav_weight_floor=6.0,
        kl_target=0.1, overlong_tokens=500, max_new_tokens=96)
    problems = "\n".join(algorithm_problems(RunConfig(algorithm=algo)))
    assert "algorithm.reward_norm.leave_one_out=true needs algorithm.reward_norm.mean_level=group" in problems
    assert "algorithm.c_clip=3.0: the dual clip is PPO's" in problems
    assert "algorithm.behav_weight_floor=6.0 exceeds algorithm.behav_weight_cap=5.0" in problems
    assert "algorithm.kl_target=0.1 adapts algorithm.kl_coef, which is 0" in problems
    assert "algorithm.overlong_tokens=500 exceeds algorithm.max_new_tokens=96" in problems
    assert "algorithm.adv_estimator='vtrace': no adv_estimator of that name; built-in: gae, returns" in problems
    assert "algorithm.reward_shapers[0]='no_such_module_xyz:f': cannot import 'no_such_module_xyz'" in problems


def test_a_critic_reads_its_old_values_and_runs_on_the_torch_engine():
    import yaml
    from omegaconf import OmegaConf

    from areal_flow.graph.dag import graph_from_config
    from areal_flow.run.checks import graph_problems

    recipe = yaml.safe_load(open("recipes/tiny_arith_ppo.yaml"))
    graph = recipe["graph"]
    graph["critic_train"]["inputs"].remove("values")
    for name in ("actor_prox", "critic_values", "actor_train", "critic_train"):
        graph[name]["engine"] = "megatron"
        graph[name].pop("row_tokens")
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), {"graph": graph, "output_dir": "x",
                                                                                  "cache_dir": "x"}))
    problems = "\n".join(graph_problems(cfg, graph_from_config(cfg)))
    assert "the critic's train node 'critic_train' must read values" in problems
    assert "node 'critic_values': the critic runs on engine torch only in this version" in problems


@pytest.mark.parametrize("config", [dict(policy_loss="ppo"), dict(policy_loss="cispo"),
                                    dict(policy_loss="ppo", importance_level="sequence", c_clip=3.0)])
def test_answers_the_train_step_may_skip_have_no_gradient(config):
    """zero_gradient's promise, checked on the objective itself: the answers it marks (all
    advantages 0) get exactly 0 gradient, and the others are not marked."""
    logp, data, mask = batch(seed=4)
    data["advantages"][data["seq_ids"] == 1] = 0.0  # the second answer: a group of equal rewards
    algo = AlgorithmConfig(behav_weight_cap=math.inf, **config)
    per_answer = [data["advantages"][data["seq_ids"] == i].numpy() for i in range(4)]
    assert zero_gradient(per_answer, algo, kl_in_loss=False) == [False, True, False, False]
    loss, _ = objective(logp, data, mask, 12.0, algo=algo, prox_source="current", prox_version=3, kl_coef=0.0)
    loss.backward()
    assert torch.all(logp.grad[data["seq_ids"] == 1] == 0)
    assert torch.all(logp.grad[data["seq_ids"] != 1] != 0)


def test_nothing_is_skipped_where_a_zero_advantage_still_has_a_gradient():
    logp, data, mask = batch(seed=5)
    data["advantages"][:] = 0.0
    algo = AlgorithmConfig(behav_weight_cap=math.inf, kl_in="loss")
    loss, _ = objective(logp, data, mask, 12.0, algo=algo, prox_source="current", prox_version=3, kl_coef=0.1)
    loss.backward()
    assert torch.all(logp.grad != 0)  # the KL term's
    answers = [data["advantages"][:3].numpy()]
    assert zero_gradient(answers, algo, kl_in_loss=True) == [False]
    assert zero_gradient(answers, AlgorithmConfig(), kl_in_loss=False) == [True]
    assert zero_gradient(answers, AlgorithmConfig(skip_zero_advantage=False), kl_in_loss=False) == [False]
    assert zero_gradient(answers, AlgorithmConfig(policy_loss="tests.losses:mine"), kl_in_loss=False) == [False]


def test_the_mismatch_is_measured_against_the_trainers_policy_at_the_steps_start():
    from areal_flow.algorithms.diagnostics import mismatch_metrics

    logp, data, mask = batch(6)
    data["prox_logprobs"] = logp.detach() + 0.01
    algo = AlgorithmConfig()

    def figures(source, at_start):
        _, stats = objective(logp, data, mask, 12.0, algo=algo, prox_source=source, prox_version=3, kl_coef=0.0,
                             at_start=at_start)
        return mismatch_metrics({k: float(v) for k, v in stats.items()})

    # π_prox from the prox node is the step's start: every minibatch measures against it.
    want = (data["prox_logprobs"] - data["behav_logprobs"]).abs().mean().item()
    assert figures("data", at_start=False)["mismatch/abs_mean"] == pytest.approx(want)
    # A shortcut or an approximation is not: only the first minibatch's own logprobs are.
    assert figures("behav", at_start=False) == {} and figures("loglinear", at_start=False) == {}
    own = (logp.detach() - data["behav_logprobs"]).abs().mean().item()
    assert figures("behav", at_start=True)["mismatch/abs_mean"] == pytest.approx(own)
    assert figures(None, at_start=True)["mismatch/abs_mean"] == pytest.approx(own)  # naive PPO too
    # by versions behind: half the tokens are 0 behind (version 3), half 2 (version 1)
    assert figures("current", at_start=False)["mismatch/2/tokens"] == 6


@pytest.mark.parametrize("how", [
    dict(),                                                  # AReaL's objective
    dict(policy_loss="cispo"),
    dict(importance_level="sequence"),                       # GSPO: one ratio a sequence
    dict(kl_in="loss", kl_estimator="k3", kl_coef=0.1),      # and KL to the reference as a loss term
    dict(eps_clip_high=0.28, c_clip=3.0, correction="tis"),
])
def test_the_per_token_terms_of_the_objective_sum_to_its_loss(how):
    """`replay --dump` writes each token's term: they must add up to the loss the step minimised."""
    logp, data, mask = batch(4)
    mask[5] = False  # a token out of the loss has no term
    data["token_weights"] = torch.linspace(0.5, 1.5, 12, dtype=torch.float64)
    kl_coef = how.pop("kl_coef", 0.0)
    algo = AlgorithmConfig(**how)
    kw = dict(algo=algo, prox_source="loglinear", prox_version=3, kl_coef=kl_coef)
    loss, _ = objective(logp, data, mask, 10.0, **kw)
    terms = objective_terms(logp.detach(), data, mask, 10.0, **kw)
    assert terms.shape == logp.shape and terms[5].item() == 0.0
    assert terms.sum().item() == pytest.approx(loss.item(), rel=1e-12, abs=1e-15)
    if how.get("importance_level") != "sequence" and not kl_coef:
        # Token by token: a term is its own token's (changing one token's logprob moves its term alone).
        moved = logp.detach().clone()
        moved[2] += 0.05
        again = objective_terms(moved, data, mask, 10.0, **kw)
        assert (again != terms).nonzero().flatten().tolist() == [2]


def test_a_users_own_policy_loss_has_no_per_token_terms():
    logp, data, mask = batch(5)

    def mine(logprobs, prox, batch, mask, denominator, algo):
        return -(logprobs * batch["advantages"]).sum() / denominator, {}

    registry.register("policy_loss", "test_terms_mine")(mine)
    algo = AlgorithmConfig(policy_loss="test_terms_mine")
    assert objective_terms(logp.detach(), data, mask, 12.0, algo=algo, prox_source="current", prox_version=3,
                           kl_coef=0.0) is None
