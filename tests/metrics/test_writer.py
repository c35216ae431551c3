import json

import pytest

from areal_flow.config.schema import MetricsConfig, WandbConfig
from areal_flow.metrics.plot import plot_learning_curve
from areal_flow.metrics.writer import MetricsWriter, read_metrics


def test_every_event_is_one_json_line_and_reads_back(tmp_path):
    w = MetricsWriter(str(tmp_path / "metrics.jsonl"))
    w.log("step", step=1, reward=0.5)
    w.log("eval", when="end", accuracy=0.75)
    w.close()
    rows = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert [r["event"] for r in rows] == ["step", "eval"] and rows[0]["reward"] == 0.5
    assert all(json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines())


@pytest.mark.slow  # wandb start-up; tests/metrics/test_backends.py reads a wandb run back (slow too)
def test_wandb_logs_offline_without_network(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = MetricsConfig(backends=["jsonl", "wandb"], wandb=WandbConfig(project="test"))  # mode: offline
    w = MetricsWriter(str(tmp_path / "metrics.jsonl"), cfg, run_name="t")
    for step in range(1, 4):
        w.log("step", step=step, reward=step / 10, note="text is not sent")
    w.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


def test_learning_curve_png(tmp_path):
    rows = [{"event": "step", "time": float(t), "reward": t / 10} for t in range(10)]
    rows += [{"event": "eval", "time": 9.0, "accuracy": 0.6}]
    path = plot_learning_curve(rows, str(tmp_path / "curve.png"), "t")
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.endswith("curve.png")
