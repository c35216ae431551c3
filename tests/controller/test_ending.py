"""Why a run ended, as summary.json's stop_reason records it (controller/ending.py)."""

import json
from types import SimpleNamespace

import pytest

from areal_flow.controller.ending import failure, record_failure, why_it_ended
from areal_flow.controller.watchdog import StalledRun


def cfg(total_steps=1000, max_wall_seconds=540.0, launcher="local"):
    return SimpleNamespace(total_steps=total_steps, max_wall_seconds=max_wall_seconds,
                           launcher=SimpleNamespace(type=launcher, slurm_stop_before=120))


def test_each_way_the_step_loop_ends_has_its_kind_and_sentence():
    assert why_it_ended(cfg(), 1000, wall_time=False) == {"kind": "total_steps", "message": "total_steps=1000 reached"}
    assert why_it_ended(cfg(), 512, wall_time=True) == \
        {"kind": "wall_time", "message": "max_wall_seconds=540 reached after 512 of 1000 steps"}
    # The last step also passed the limit: the run did all it was asked.
    assert why_it_ended(cfg(), 1000, wall_time=True)["kind"] == "total_steps"
    stop = why_it_ended(cfg(), 37, wall_time=False)
    assert stop["kind"] == "stop_request" and stop["message"].endswith("after 37 of 1000 steps")
    assert "SIGUSR1: the launcher's Ctrl-C or SIGTERM" in stop["message"]
    slurm = cfg(launcher="slurm")
    assert "SIGUSR1: the Slurm job's, 120 s before launcher.slurm_time's limit or by `scancel --batch " \
           "--signal=USR1`) after 37 of 1000 steps" in why_it_ended(slurm, 37, wall_time=False)["message"]


def test_any_exception_that_ends_the_controller_is_its_reason_on_one_line():
    assert failure(StalledRun("no train step completed within 6 s (step_timeout);\n  the controller waits")) == \
        {"kind": "failure",
         "message": "StalledRun: no train step completed within 6 s (step_timeout); the controller waits"}
    assert failure(KeyError("rank"))["message"] == "KeyError: 'rank'"
    assert failure(RuntimeError())["message"] == "RuntimeError: (no message)"


def test_a_failure_is_logged_as_a_failure_row_even_when_the_metrics_file_is_closed(tmp_path):
    from areal_flow.metrics.writer import MetricsWriter

    writer = MetricsWriter(str(tmp_path / "metrics.jsonl"))
    reason = record_failure(writer, StalledRun("dynamic filtering dropped every group"))
    writer.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["event"], r["stop_reason"]) for r in rows] == [("failure", reason)]
    assert reason["message"] == "StalledRun: dynamic filtering dropped every group"
    # After the summary the file is closed: the reason is still returned (for the log), not raised over.
    assert record_failure(writer, ValueError("late"))["message"] == "ValueError: late"
    with pytest.raises(ValueError):
        writer.log("x")
