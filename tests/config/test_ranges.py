"""Value ranges are declared on the schema's fields and checked by one generic checker."""

from areal_flow.config.nodes import BatchNodeConfig, CombineNodeConfig, RewardNodeConfig
from areal_flow.config.schema import RunConfig
from areal_flow.config.validate import check_ranges


def test_the_defaults_are_in_range():
    assert check_ranges(RunConfig()) == []


def test_every_broken_bound_is_named_with_its_full_key_nested_and_in_graph_nodes():
    cfg = RunConfig()
    cfg.algorithm.top_p = 1.5
    cfg.algorithm.temperature = 0.0
    cfg.rollout.max_staleness = -1
    cfg.dataset.name = "parquet"
    cfg.graph = {"train": BatchNodeConfig(type="train", micro_batch_tokens=0)}
    assert sorted(check_ranges(cfg)) == sorted([
        "algorithm.top_p=1.5 must be ≤ 1",
        "algorithm.temperature=0.0 must be > 0",
        "rollout.max_staleness=-1 must be ≥ 0",
        "dataset.name='parquet' must be one of tiny_arith, tiny_code, jsonl, areal_math, areal_code, humaneval",
        "graph.train.micro_batch_tokens=0 must be ≥ 1",
    ])


def test_a_null_optional_value_is_not_range_checked():
    cfg = RunConfig()
    cfg.algorithm.eps_clip_high = None
    cfg.algorithm.behav_weight_cap = None
    assert check_ranges(cfg) == []
    cfg.algorithm.behav_weight_cap = 0.5
    assert check_ranges(cfg) == ["algorithm.behav_weight_cap=0.5 must be ≥ 1"]


def test_nan_and_inf_are_refused_in_every_float_field_nested_in_lists_and_dicts():
    # Every comparison with NaN is false, so no bound caught it: algorithm.eps_clip=nan trained.
    nan, inf = float("nan"), float("inf")
    cfg = RunConfig()
    cfg.algorithm.eps_clip = nan
    cfg.algorithm.lr = -inf
    cfg.algorithm.top_p = inf  # not also "must be ≤ 1": one problem per key
    cfg.algorithm.betas = [0.9, nan]
    cfg.algorithm.success_rate_range = [0.0, inf]
    cfg.algorithm.behav_weight_cap = None
    cfg.algorithm.reward_norm.eps = nan
    cfg.sandbox.wall_seconds = inf
    cfg.graph = {"reward": RewardNodeConfig(type="reward", scale=nan, timeout=inf),
                 "total": CombineNodeConfig(type="combine", weights={"a": 1.0, "b": nan})}
    assert sorted(check_ranges(cfg)) == sorted([
        "algorithm.eps_clip=nan: must be a finite number",
        "algorithm.lr=-inf: must be a finite number",
        "algorithm.top_p=inf: must be a finite number",
        "algorithm.betas[1]=nan: must be a finite number",
        "algorithm.success_rate_range[1]=inf: must be a finite number",
        "algorithm.reward_norm.eps=nan: must be a finite number",
        "sandbox.wall_seconds=inf: must be a finite number",
        "graph.reward.scale=nan: must be a finite number",
        "graph.reward.timeout=inf: must be a finite number",
        "graph.total.weights.b=nan: must be a finite number",
    ])


def test_each_item_of_a_list_field_is_one_of_its_choices():
    cfg = RunConfig()
    cfg.metrics.backends = ["jsonl", "tensorbord", "wandb"]
    cfg.metrics.wandb.mode = "online"
    assert check_ranges(cfg) == ["metrics.backends=['jsonl', 'tensorbord', 'wandb'] has 'tensorbord': each item must be "
                                 "one of jsonl, tensorboard, wandb"]
    cfg.metrics.backends, cfg.metrics.wandb.mode = ["jsonl", "tensorboard"], "remote"
    assert check_ranges(cfg) == ["metrics.wandb.mode='remote' must be one of online, offline, disabled"]
