"""A step's row: its length-bias and staleness metrics (controller/run_metrics.py), from the groups'
metadata (batch_metrics) and from the trainer ranks' summed stats (train_metrics); and the step's
window, the row as a whole and its alarms (controller/step_metrics.py)."""

import asyncio
import json

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


# ---- the step's window and its row (step_metrics.py) ----------------------------------------

def step_metrics(tmp_path, counts, **kw):
    from areal_flow.config.schema import AlgorithmConfig
    from areal_flow.controller.step_metrics import StepMetrics
    from areal_flow.controller.watchdog import Progress
    from areal_flow.metrics.writer import MetricsWriter

    algo = AlgorithmConfig(max_new_tokens=40, **kw)
    return StepMetrics(algo, MetricsWriter(str(tmp_path / "metrics.jsonl")), Progress(), counts, reward_key="rewards",
                       output_key="output_ids", max_staleness=2, suspect_warn=0.05, judges=["judge"])


def test_a_window_is_what_the_servers_counted_between_two_step_ends(tmp_path):
    from areal_flow.controller.watchdog import Wait

    readings = iter([{"busy_seconds": 1.0, "judge/busy_seconds": 0.5},
                     {"busy_seconds": 3.0, "judge/busy_seconds": 2.0, "load_seconds": 9.0},  # new: no difference
                     {"busy_seconds": 4.0}])

    async def counts():
        return next(readings)

    metrics = step_metrics(tmp_path, counts)

    async def scenario():
        await metrics.restart()
        first = await metrics.end()
        assert str(metrics.progress.waiting) == str(Wait.SERVER_COUNTS.of())
        return first, await metrics.end()

    first, second = asyncio.run(scenario())
    assert first.servers == {"busy_seconds": 2.0, "judge/busy_seconds": 1.5} and first.seconds > 0 and first.cpu >= 0
    assert second.servers == {"busy_seconds": 1.0}  # the next window starts where the last ended


def test_the_row_relates_the_step_to_its_window_and_ends_with_the_runs_own_figures(tmp_path):
    from areal_flow.controller.step_metrics import Batch, Trained, Window

    async def counts():
        return {}

    metrics = step_metrics(tmp_path, counts)
    batch = Batch({g.group_id: (g, 0, 10) for g in GROUPS}, reward_wait=0.5)
    done = Trained(5, batch, trainer_stats([], n_tokens=400.0), seconds=2.0, at=30.0,
                   window=Window(10.0, {"busy_seconds": 8.0, "judge/busy_seconds": 4.0}, 1.0))
    row = metrics.row(done, update_seconds=0.3, samples=5, generated_tokens=100, run={"elapsed": 31.0, "buffered": 2})
    assert row["step"] == 6 and row["staleness_seq_hist"] == [2, 1, 1, 1]  # the groups' metrics, as above
    assert (row["step_seconds"], row["train_seconds"], row["update_seconds"], row["trained_at"]) == (10.0, 2.0, 0.3, 30.0)
    assert row["samples_per_second"] == 0.5 and row["gen_tokens_per_second"] == 10.0
    assert row["train_tokens_per_second"] == 200.0 and row["trainer_idle"] == pytest.approx(0.8)
    assert row["trainer_reward_wait"] == 0.05 and row["generator_idle"] == pytest.approx(0.2)
    assert row["generator_load"] is None and row["judge_idle/judge"] == pytest.approx(0.6)
    assert row["controller_cpu_fraction"] == 0.1 and "sent_bytes/controller" in row
    assert list(row)[-2:] == ["elapsed", "buffered"]


def test_a_row_past_the_suspect_share_is_logged_with_its_warning(tmp_path):
    from areal_flow.controller.step_metrics import StepMetrics

    async def counts():
        return {}

    metrics: StepMetrics = step_metrics(tmp_path, counts)
    metrics.log({"step": 3, "reward/suspect": 0.5})
    metrics.log({"step": 4, "reward/suspect": 0.5})  # said once
    metrics.metrics.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["event"], r["step"]) for r in rows] == [("step", 3), ("warning", 3), ("step", 4)]
    assert rows[1]["kind"] == "reward_hacking" and rows[0]["stale_trouble_steps"] == 0


def test_the_first_step_whose_agents_drifted_is_warned_once_with_its_dropped_tokens(tmp_path):
    from areal_flow.controller.step_metrics import StepMetrics

    async def counts():
        return {}

    metrics: StepMetrics = step_metrics(tmp_path, counts)
    metrics.log({"step": 1, "agent/drifts": 0.0, "agent/drift_rate": 0.0, "agent/dropped_tokens": 0.0})
    metrics.log({"step": 2, "agent/drifts": 0.5, "agent/drift_rate": 0.25, "agent/dropped_tokens": 31.0})
    metrics.log({"step": 3, "agent/drifts": 1.0, "agent/drift_rate": 0.5, "agent/dropped_tokens": 40.0})
    metrics.metrics.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["event"], r["step"]) for r in rows] == [("step", 1), ("step", 2), ("warning", 2), ("step", 3)]
    assert rows[2]["kind"] == "agent_drift"
    assert rows[2]["message"].startswith("step 2: agent calls drifted (25.0% of the step's calls): 31 policy tokens")
