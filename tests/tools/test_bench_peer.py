"""tools/bench_peer.py's reading of two learning curves (the runs themselves need the [bench] extra)."""

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import bench_peer  # noqa: E402


def test_accuracy_at_a_time_is_the_last_checkpoint_before_it_and_reaching_is_the_first_at_or_above():
    points = [(0.0, 0.25), (100.0, 0.50), (200.0, 0.45), (300.0, 0.60)]
    assert bench_peer.accuracy_at(points, 250.0) == 0.45 and bench_peer.accuracy_at(points, 100.0) == 0.50
    assert bench_peer.time_to_reach(points, 0.5) == 100.0 and bench_peer.time_to_reach(points, 0.7) is None
    with pytest.raises(ValueError, match="no checkpoint at or before"):
        bench_peer.accuracy_at([(10.0, 0.3)], 5.0)


def test_the_late_mean_averages_the_checkpoints_of_the_budgets_second_half():
    points = [(0.0, 0.25), (100.0, 0.50), (270.0, 0.40), (400.0, 0.60), (540.0, 0.56)]
    assert bench_peer.late_mean(points, 540.0) == pytest.approx((0.40 + 0.60 + 0.56) / 3)
    with pytest.raises(ValueError, match="no checkpoint at or after 270 s"):
        bench_peer.late_mean(points[:2], 540.0)


def test_the_report_gives_the_ratios_of_the_two_runs():
    peer = bench_peer.Curve("TRL", [], samples=5000, seconds=100.0)
    ours = bench_peer.Curve("areal_flow", [], samples=10000, seconds=100.0)
    points = {"TRL": [(0.0, 0.2), (50.0, 0.4), (100.0, 0.5)],
              "areal_flow": [(0.0, 0.2), (40.0, 0.5), (100.0, 0.6)]}
    args = SimpleNamespace(task="tiny_arith", budget=100.0, eval_n=20, seed=1, peer_from=None, overrides=[])
    text = bench_peer.report(peer, ours, points, 100.0, 0.61, args)
    assert "| trained samples/s | 50.0 | 100.0 | 2.00× |" in text
    assert "| accuracy at 50 s | 40.0% | 50.0% | +10.0 points |" in text
    assert "| accuracy at the end (100 s, 100 s) | 50.0% | 60.0% | +10.0 points |" in text
    assert "| time to 50.0% (the peer's final) | 100 s | 40 s | 0.40 of the peer's time |" in text
    assert "| mean of the checkpoints from 50 s on | 45.0% | 60.0% | +15.0 points |" in text
    assert "| generated samples/s | 50.0 | 100.0 | 2.00× |" in text  # without filtering: those trained
    assert "with a gradient" not in text  # neither run says how many of its groups had one
    assert "own end-of-run evaluation (its engine, greedy, same file): 61.0%" in text


def test_with_dynamic_filtering_the_report_compares_generated_answers_and_those_with_a_gradient():
    # TRL trains all it generates, 60% of its groups without a gradient; areal_flow generated 3×
    # what it trained and filtered out the 2 in 3 groups without one.
    peer = bench_peer.Curve("TRL", [], samples=5000, seconds=100.0, no_gradient=0.6)
    ours = bench_peer.Curve("areal_flow", [], samples=5000, seconds=100.0, generated=15000, no_gradient=2 / 3)
    points = {name: [(0.0, 0.2), (100.0, 0.5)] for name in ("TRL", "areal_flow")}
    text = bench_peer.report(peer, ours, points, 100.0, None, SimpleNamespace(
        task="tiny_arith", budget=100.0, eval_n=20, seed=1, peer_from=None, overrides=[]))
    assert "| generated samples/s | 50.0 | 150.0 | 3.00× |" in text
    assert "| trained samples/s | 50.0 | 50.0 | 1.00× |" in text
    assert "| generated groups whose answers all score alike (no gradient) | 60% | 67% (filtered) | |" in text
    assert "| generated samples/s in groups with a gradient | 20.0 | 50.0 | 2.50× |" in text


def test_scores_kept_in_a_run_folder_are_read_back_and_only_the_missing_ones_are_scored(tmp_path, monkeypatch):
    """What --reuse and --peer-from rely on: a call scores each checkpoint once, keeps it in the
    side's scores.json, and a later call reads it instead of loading the model again."""
    trl_dir, ours_dir = tmp_path / "trl", tmp_path / "areal_flow"
    trl_dir.mkdir(), ours_dir.mkdir()
    rows = [{"prompt": "1+1=", "answer": "2"}] * 3
    (trl_dir / "scores.json").write_text('{"start@3": 0.25, "step49@3": 0.5}')
    peer = bench_peer.Curve("TRL", [(45.0, str(trl_dir / "step49"))], samples=10, seconds=45.0)
    ours = bench_peer.Curve("areal_flow", [(40.0, str(ours_dir / "weights" / "v100"))], samples=20, seconds=40.0)
    scored = []

    def evaluator(base, rows_, task, cache_dir):
        return lambda path: scored.append((path, len(rows_))) or 0.75

    monkeypatch.setattr(bench_peer, "_evaluator", evaluator)
    points = bench_peer.score([(peer, str(trl_dir)), (ours, str(ours_dir))], "base", rows, "tiny_arith", "cache")
    assert points == {"TRL": [(0.0, 0.25), (45.0, 0.5)], "areal_flow": [(0.0, 0.25), (40.0, 0.75)]}
    assert scored == [(str(ours_dir / "weights" / "v100"), 3)]  # neither the start nor TRL's checkpoint again
    assert (ours_dir / "scores.json").read_text() == '{"start@3": 0.25, "v100@3": 0.75}'

    scored.clear()
    again = bench_peer.score([(ours, str(ours_dir))], "base", rows, "tiny_arith", "cache")
    assert again["areal_flow"] == points["areal_flow"]
    assert scored == []
    bench_peer.score([(ours, str(ours_dir))], "base", rows * 2, "tiny_arith", "cache")  # another held-out set: scored again
    assert scored == [("base", 6), (str(ours_dir / "weights" / "v100"), 6)]


def test_reading_a_folder_without_a_finished_trl_run_says_which(tmp_path):
    with pytest.raises(SystemExit, match="no finished TRL run"):
        bench_peer.read_trl(str(tmp_path))


def test_the_report_gives_each_sides_reward_seconds_a_sample():
    peer = bench_peer.Curve("TRL", [], samples=640, seconds=100.0, reward_seconds=0.004)
    ours = bench_peer.Curve("areal_flow", [], samples=640, seconds=100.0, reward_seconds=0.010)
    points = {name: [(0.0, 0.3), (100.0, 0.5)] for name in ("TRL", "areal_flow")}
    text = bench_peer.report(peer, ours, points, 100.0, None, SimpleNamespace(
        task="tiny_code", budget=100.0, eval_n=200, seed=1, peer_from=None, overrides=[]))
    assert "| reward's seconds a sample | 4.0 ms | 10.0 ms (a worker's) | 2.50× |" in text
    assert "--task tiny_code" in text and "the figure: pass@1" in text


@pytest.mark.skipif(os.geteuid() != 0, reason="the code sandbox's namespaces need root, as on CI")
def test_the_code_task_takes_the_recipes_settings_and_scores_with_the_sandboxed_code_reward(tmp_path):
    cfg = bench_peer.recipe_config("tiny_code", str(tmp_path), 200)
    task = bench_peer.TASKS["tiny_code"]
    assert (cfg.recipe, cfg.algorithm.max_new_tokens, cfg.max_wall_seconds) == (task.recipe, task.max_new, task.budget)
    assert (cfg.algorithm.group_size, cfg.algorithm.batch_size, cfg.algorithm.lr) == (
        bench_peer.GROUP, bench_peer.PROMPTS, bench_peer.LR)
    row = {"input_output": {"inputs": [[2], [3]], "outputs": [4, 9], "fn_name": "square"}}
    reward = bench_peer.reward_function("tiny_code", str(tmp_path), 200)
    assert reward("def square(x):\n    return x * x\n", row) == 1.0
    assert reward("def square(x):\n    return 2 * x\n", row) == 0.0  # right on 2 only: no partial credit
    assert reward("import os\nos._exit(0)\n", row) == 0.0
