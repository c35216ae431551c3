"""tools/plot_seeds.py: runs' held-out curves placed at training time, the table's gains, and a
run without evaluations refused by its file."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"
sys.path.insert(0, str(TOOLS))
from plot_seeds import held_out_curve  # noqa: E402


def write_run(path: Path, accuracies: dict[int, float], seconds_per_step: float) -> Path:
    path.mkdir()
    steps = max(accuracies)
    rows = [{"event": "step", "step": s, "elapsed": s * seconds_per_step} for s in range(1, steps + 1)]
    rows += [{"event": "eval", "step": s, "version": s, "accuracy": a, "agent/reward/checker": 1 - a}
             for s, a in accuracies.items()]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_evaluations_sit_at_the_training_time_of_the_step_they_followed(tmp_path):
    run = write_run(tmp_path / "seed1", {0: 0.3, 2: 0.4, 4: 0.6}, seconds_per_step=2.5)
    assert held_out_curve(run) == ([(0.0, 0.3), (5.0, 0.4), (10.0, 0.6)], 4)


def test_the_table_gives_each_gain_and_their_mean_and_the_plot_is_written(tmp_path):
    runs = [write_run(tmp_path / "a", {0: 0.3, 3: 0.5}, 1.0), write_run(tmp_path / "b", {0: 0.3, 3: 0.6}, 1.0)]
    out = tmp_path / "seeds.png"
    r = subprocess.run([sys.executable, str(TOOLS / "plot_seeds.py"), *map(str, runs), "--out", str(out),
                        "--figure", "agent/reward/checker"],
                       capture_output=True, text=True, timeout=120, env={"COLUMNS": "200", "PATH": ""})
    assert r.returncode == 0, r.stderr
    assert "+20.0" in r.stdout and "+30.0" in r.stdout and "+25.0 ± 7.1" in r.stdout
    assert "-25.0 ± 7.1" in r.stdout  # the second figure's table: another role's held-out reward
    assert out.stat().st_size > 1000


def test_a_run_without_evaluations_is_refused_naming_its_file(tmp_path):
    run = tmp_path / "none"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"event": "step", "step": 1, "elapsed": 1.0}) + "\n")
    with pytest.raises(ValueError, match=r"none/metrics.jsonl: no held-out evaluation"):
        held_out_curve(run)


def test_a_figure_an_evaluation_lacks_is_refused_naming_it(tmp_path):
    run = write_run(tmp_path / "seed1", {0: 0.3, 2: 0.4}, 1.0)
    with pytest.raises(ValueError, match=r"seed1/metrics.jsonl: the evaluation at version 0 has no 'agent/x'"):
        held_out_curve(run, "agent/x")
