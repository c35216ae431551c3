"""A step row's length-bias and staleness metrics (controller/run_metrics.py): from the groups'
metadata (batch_metrics) and from the trainer ranks' summed stats (train_metrics)."""

import numpy as np
import pytest

from areal_flow.algorithms.diagnostics import BEHAV_WEIGHT_BIN, behav_weight_edges, length_bucket_sums
from areal_flow.controller.run_metrics import batch_metrics, behav_weight_hist, train_metrics
from areal_flow.transport.messages import Finish, GroupMeta, SampleMeta


def sample(uid: str, answer: int, versions: dict[int, int], reward: float, finish: Finish = Finish.STOP) -> SampleMeta:
    return SampleMeta(uid, 0, {"prompt_ids": 3, "output_ids": answer}, versions, {"rewards": reward}, finish)


# max_new_tokens 40: q1 <= 10, q2 <= 20, q3 <= 30, q4 above.
GROUPS = [GroupMeta(0, "w", [sample("a", 10, {5: 10}, 1.0), sample("b", 11, {4: 5, 5: 6}, 0.0),
                             sample("c", 40, {2: 30, 5: 10}, 0.5, Finish.LENGTH)]),
          GroupMeta(1, "w", [sample("d", 5, {3: 5}, 0.0), sample("e", 25, {5: 25}, 1.0)])]


def test_reward_and_samples_by_length_quarter():
    m = batch_metrics(GROUPS, step=5, reward_key="rewards", output_key="output_ids", max_new_tokens=40)
    assert [m[f"by_length/samples/q{k}"] for k in range(1, 5)] == [2, 1, 1, 1]
    assert m["by_length/reward/q1"] == pytest.approx((1.0 + 0.0) / 2)  # a (10 = 25%) and d
    assert (m["by_length/reward/q2"], m["by_length/reward/q3"], m["by_length/reward/q4"]) == (0.0, 1.0, 0.5)
    assert m["truncated_fraction"] == pytest.approx(1 / 5)
    # An empty quarter has no mean; without a budget, no by_length keys at all.
    m = batch_metrics(GROUPS[:1], step=5, reward_key="rewards", output_key="output_ids", max_new_tokens=40)
    assert m["by_length/reward/q3"] is None and m["by_length/samples/q3"] == 0
    assert not any(k.startswith("by_length/") for k in batch_metrics(GROUPS, 5, "rewards", "output_ids"))


def test_sequence_staleness_counts_each_answer_once_by_its_oldest_token():
    m = batch_metrics(GROUPS, step=5, reward_key="rewards", output_key="output_ids", max_new_tokens=40)
    # Oldest versions 5, 4, 2, 3, 5 at step 5: ages 0, 1, 3, 2, 0.
    assert m["staleness_seq_hist"] == [2, 1, 1, 1]
    # The token histogram is unchanged: 10 + 6 + 10 + 25 tokens of age 0, 5 of 1, 5 of 2, 30 of 3.
    assert m["staleness_hist"] == [51, 5, 5, 30]
    no_versions = [GroupMeta(0, "w", [sample("a", 4, {}, 1.0)])]
    assert batch_metrics(no_versions, step=3, reward_key="rewards", output_key="output_ids")["staleness_seq_hist"] == [0]


def trainer_stats(bins: list[int], **more) -> dict[str, float]:
    stats = {"loss": 0.1, "n_tokens": 500.0, "n_valid_tokens": 100.0, "skipped_tokens": 0.0, **more}
    stats.update({BEHAV_WEIGHT_BIN.format(i): float(c) for i, c in enumerate(bins)})
    return stats


def test_the_weight_histogram_is_assembled_with_its_edges_and_the_ratios_formed():
    edges = behav_weight_edges(5.0)
    bins = [0] * (len(edges) - 1)
    bins[5], bins[6], bins[10] = 60, 30, 10  # 100 tokens: (.95, 1.05], (1.05, 1.25], 10 above the cap 5
    row = train_metrics(trainer_stats(bins, capped_tokens=10.0, behav_weight_sum=120.0, behav_weight_sq_sum=400.0),
                        behav_weight_cap=5.0)
    assert row["train/behav_weight_hist"] == bins and row["train/behav_weight_hist_edges"] == edges
    assert row["train/capped_fraction"] == pytest.approx(0.1)
    assert row["train/ess_fraction"] == pytest.approx(120.0 ** 2 / (100 * 400.0))
    # The other stats pass through as train/<key>; the per-bin scalars do not.
    assert row["train/loss"] == 0.1 and row["train/behav_weight_sq_sum"] == 400.0
    assert not any(k.startswith("train/behav_weight_bin") for k in row)
    assert behav_weight_hist({}) == []


def test_skipped_answers_are_not_in_the_token_count_of_the_ratios():
    # No histogram (a loss function of one's own): N = n_valid_tokens − skipped_tokens.
    row = train_metrics({"n_valid_tokens": 100.0, "skipped_tokens": 20.0, "capped_tokens": 8.0,
                         "behav_weight_sum": 80.0, "behav_weight_sq_sum": 80.0})
    assert row["train/capped_fraction"] == pytest.approx(0.1) and row["train/ess_fraction"] == pytest.approx(1.0)
    assert "train/behav_weight_hist" not in row
    # A step whose loss ran no token has no ratio.
    row = train_metrics({"n_valid_tokens": 4.0, "skipped_tokens": 4.0, "capped_tokens": 0.0,
                         "behav_weight_sum": 0.0, "behav_weight_sq_sum": 0.0})
    assert row["train/capped_fraction"] is None and row["train/ess_fraction"] is None


def test_advantage_and_loss_share_by_length_are_finished_from_the_ranks_sums():
    # Two ranks' sums added, as the trainer's all-reduce does.
    rank0 = length_bucket_sums([2, 8], [np.full(2, 1.0), np.full(8, -1.0)], [np.ones(2, bool), np.ones(8, bool)], None, 8)
    rank1 = length_bucket_sums([3], [np.full(3, 2.0)], [np.ones(3, bool)], None, 8)
    stats = {k: rank0[k] + rank1[k] for k in rank0}
    row = train_metrics(stats)
    assert (row["by_length/advantage/q1"], row["by_length/advantage/q2"], row["by_length/advantage/q4"]) == (1.0, 2.0, -1.0)
    assert row["by_length/advantage/q3"] is None
    total = 2 + 6 + 8  # Σ|A| over tokens under token-mean
    assert [row[f"by_length/loss_share/q{k}"] for k in range(1, 5)] == pytest.approx([2 / total, 6 / total, 0, 8 / total])
    assert not any(k.startswith("train/by_length") for k in row)  # the raw sums are not in the row
