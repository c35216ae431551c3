"""The launcher's console view of a run (launchers/progress.py), fed by metrics.jsonl rows."""

import io
import json

import pytest
from rich.console import Console

from areal_flow.launchers.progress import RunProgress, summary_table


def step_row(step: int, reward: float) -> dict:
    return {"event": "step", "step": step, "reward": reward, "staleness_max": 1, "samples_per_second": 10.0}


def append(path, *rows: dict) -> None:
    with open(path, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def piped() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=False, width=200), out


def test_after_a_resume_the_first_line_is_the_resumed_runs_own_step(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    # The file a resumed run starts with: cut back to its checkpoint of step 3.
    append(metrics, {"event": "start"}, *(step_row(s, 0.1 * s) for s in (1, 2, 3)))
    console, out = piped()
    with RunProgress(str(metrics), 20, console) as progress:
        append(metrics, {"event": "start"}, {"event": "resume", "step": 3})
        progress.tick()
        assert progress.progress.tasks[0].completed == 3  # the bar starts where the run goes on
        append(metrics, step_row(4, 0.9), step_row(5, 0.8))
        progress.tick()
        append(metrics, *(step_row(s, 0.7) for s in range(6, 11)))
        progress.tick()
    lines = [line for line in out.getvalue().splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in lines] == ["step 4", "step 10"]
    assert lines[0].startswith("step 4: reward 0.90")


@pytest.mark.parametrize("kind, message, said", [
    ("wall_time", "max_wall_seconds=540 reached after 512 of 1000 steps", "run stopped early: "),
    ("total_steps", "total_steps=1000 reached", "run finished: "),
])
def test_the_end_of_the_run_says_why_on_the_console_the_bar_and_the_summary_table(tmp_path, kind, message, said):
    metrics = tmp_path / "metrics.jsonl"
    console, out = piped()
    reason = {"kind": kind, "message": message}
    summary = {"steps": 512, "stop_reason": reason, "accuracy_start": None, "accuracy_end": 0.5, "trained_samples": 8,
               "train_wall_seconds": 540.0, "samples_per_second": 1.0, "trainer_busy_fraction": 0.5, "checkpoint": None}
    with RunProgress(str(metrics), 1000, console) as progress:
        append(metrics, step_row(512, 0.5), {"event": "summary", **summary})
        progress.tick()
    assert f"{said}{message}\n" in out.getvalue()
    task = progress.progress.tasks[0]
    assert task.description == ("done" if kind == "total_steps" else "stopped early") and task.fields["info"] == message
    table = io.StringIO()
    Console(file=table, width=200).print(summary_table(summary, []))
    assert "why it ended" in table.getvalue() and message in table.getvalue()


def test_a_controller_that_failed_leaves_its_reason_on_the_bar_read_after_the_last_tick(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    console, out = piped()
    reason = {"kind": "failure", "message": "StalledRun: no train step completed within 6 s (step_timeout)"}
    with pytest.raises(RuntimeError):
        with RunProgress(str(metrics), 1000, console) as progress:
            append(metrics, step_row(1, 0.5), {"event": "failure", "stop_reason": reason})
            raise RuntimeError("the launcher saw the controller die before its next tick")
    task = progress.progress.tasks[0]
    assert (task.description, task.fields["info"]) == ("failed", reason["message"])
    # The bar's last view says it; the launcher prints the failure's own line (run/start.py).
    assert not any(line.startswith("run ") for line in out.getvalue().splitlines())
    # A process that died without a failure row (not the controller): the bar still says it failed.
    with pytest.raises(KeyboardInterrupt):
        with RunProgress(str(tmp_path / "other.jsonl"), 10, piped()[0]) as progress:
            raise KeyboardInterrupt
    assert progress.progress.tasks[0].description == "interrupted"


def test_a_warning_row_is_printed_once_as_written(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    console, out = piped()
    with RunProgress(str(metrics), 20, console) as progress:
        append(metrics, step_row(1, 0.5), {"event": "warning", "step": 1, "kind": "staleness",
                                           "message": "staleness: lower rollout.max_staleness [not markup]"})
        progress.tick()
        progress.tick()
    assert out.getvalue().count("warning: staleness: lower rollout.max_staleness [not markup]") == 1


def test_the_summary_table_gives_the_trainers_wait_on_rewards_and_each_reward_nodes_busy_share():
    summary = {"steps": 2, "accuracy_start": 0.1, "accuracy_end": 0.5, "trained_samples": 8, "train_wall_seconds": 9.0,
               "samples_per_second": 1.0, "trainer_busy_fraction": 0.9, "checkpoint": "ckpt"}
    steps = [{"event": "step", "staleness_max": 1, "trainer_reward_wait": w, "reward_busy/code": b}
             for w, b in ((0.02, 0.3), (0.06, 0.5))]
    table = io.StringIO()
    Console(file=table, width=200).print(summary_table(summary, steps))
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in table.getvalue().splitlines()
            if line.count("│") == 3}
    assert rows["trainer waiting on rewards"] == "4.0%" and rows["reward workers busy (code)"] == "40.0%"
    assert "weight updates" not in rows  # no step said how long its update took
    assert "suspect samples (gamed or hedged)" not in rows  # no step had a reward that flags samples
    steps[0]["reward/suspect"], steps[1]["reward/suspect"] = 0.0, 0.25
    table = io.StringIO()
    Console(file=table, width=200).print(summary_table(summary, steps))
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in table.getvalue().splitlines()
            if line.count("│") == 3}
    assert rows["suspect samples (gamed or hedged)"] == "12.5% (max 25.0%)"


def test_the_summary_table_gives_the_weight_updates_share_of_the_steps():
    summary = {"steps": 2, "accuracy_start": 0.1, "accuracy_end": 0.5, "trained_samples": 8, "train_wall_seconds": 9.0,
               "samples_per_second": 1.0, "trainer_busy_fraction": 0.9, "checkpoint": "ckpt"}
    steps = [{"event": "step", "staleness_max": 1, "step_seconds": 6.0, "update_seconds": 0.2, "train/publish_seconds": 1.0},
             {"event": "step", "staleness_max": 1, "step_seconds": 4.0, "update_seconds": 0.3}]
    table = io.StringIO()
    Console(file=table, width=200).print(summary_table(summary, steps))
    assert "│ weight updates (of a step) │ 15.0% │" in table.getvalue()  # (1.2 + 0.3) / 10
    # With the servers' own load time (a share of each step), the update splits into its parts.
    steps[0]["generator_load"], steps[1]["generator_load"] = 0.01, 0.05  # 0.06 s and 0.2 s of loading
    table = io.StringIO()
    Console(file=table, width=200).print(summary_table(summary, steps))
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in table.getvalue().splitlines()
            if line.count("│") == 3}
    assert rows["weight updates (of a step)"] == "15.0%" and rows["the trainer writing them"] == "10.0%"
    assert rows["the servers finishing or cutting answers"] == "2.4%"  # (0.5 - 0.26) / 10
    assert rows["the servers loading them"] == "2.6%"
    # A run from before the figure existed shows no row rather than 0%.
    table = io.StringIO()
    Console(file=table, width=200).print(summary_table(summary, [{"event": "step", "staleness_max": 1}]))
    assert "waiting on rewards" not in table.getvalue()
