"""The metrics backends write what they say: TensorBoard's event files and wandb's offline run
file are read back with their own readers; a backend not listed is not imported."""

import json
import logging
import os
import struct
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import pytest

from areal_flow.config.schema import MetricsConfig, WandbConfig
from areal_flow.metrics.backends import (Backend, hist_stats, hydra_wandb_group, multirun_group, run_name_default,
                                         split_row)
from areal_flow.metrics.writer import MetricsWriter, read_metrics

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = [{"prompt": "1+1=", "answer": "2 | two\nlines", "reference": "2", "score": 1.0},
           {"prompt": "2+2=", "answer": "5", "reference": "4", "score": 0.0}]


def log_a_run(w: MetricsWriter) -> None:
    w.log("start", total_steps=3, batch_size=4)
    for step in (1, 2, 3):
        w.log("step", step=step, reward=step / 10, n_groups=step * 2, filtered=step == 2, skipped=None, when="now",
              staleness_hist=[4, step, 0], length_hist=[1, 2], length_hist_edges=[0.0, 8.0, 32.0],
              **{"train/loss": 1.0 / step})
    w.log("eval", when="version 2", step=2, version=2, accuracy=0.75, answer_versions={"2": 8}, seconds=1.5,
          samples=SAMPLES)
    w.log("summary", steps=3, accuracy_end=0.75, checkpoint="/runs/a/checkpoint")
    w.close()


# ---- the conventions -----------------------------------------------------------------------------

def test_a_row_splits_into_scalars_histograms_tables_and_strings():
    row = split_row({"step": 5, "reward": 0.5, "n": 3, "ok": True, "gone": None, "when": "end",
                     "versions": {"3": 2, "4": {"deep": 1}}, "staleness_hist": [2, 0, 1],
                     "len_hist": [1, 1], "len_hist_edges": [0, 10, 100], "plain": [1, 2, 3], "empty_hist": [],
                     "samples": [{"prompt": "p", "score": 1}, {"answer": "a", "extra": [1]}]}, "eval/")
    assert row.scalars == {"eval/reward": 0.5, "eval/n": 3, "eval/ok": 1, "eval/versions/3": 2, "eval/versions/4/deep": 1}
    assert isinstance(row.scalars["eval/n"], int) and isinstance(row.scalars["eval/ok"], int)
    assert row.histograms == {"eval/staleness_hist": ([2, 0, 1], [-0.5, 0.5, 1.5, 2.5]),
                              "eval/len_hist": ([1, 1], [0, 10, 100])}
    assert row.tables == {"eval/samples": (["prompt", "score", "answer", "extra"],
                                           [["p", 1, None, None], [None, None, "a", "[1]"]])}
    assert row.strings == {"eval/when": "end"}


def test_histogram_edges_that_do_not_fit_skip_the_histogram(caplog):
    with caplog.at_level(logging.WARNING):
        row = split_row({"a_hist": [1, 2], "a_hist_edges": [0, 1], "b_hist": [1], "b_hist_edges": [1, 0]})
    assert row.histograms == {} and row.scalars == {}
    assert "a_hist_edges is not 3 increasing bin edges" in caplog.text


def test_tensorboard_histogram_stats_from_counts_and_edges():
    stats = hist_stats([0, 2, 1, 0], [-0.5, 0.5, 1.5, 2.5, 3.5])  # the values 1, 1, 2
    assert stats == dict(min=0.5, max=2.5, num=3, sum=4.0, sum_squares=6.0, bucket_limits=[0.5, 1.5, 2.5, 3.5],
                         bucket_counts=[0, 2, 1, 0])
    empty = hist_stats([0, 0], [0.0, 1.0, 2.0])
    assert (empty["min"], empty["max"], empty["num"]) == (0.0, 2.0, 0)


def test_run_name_and_multirun_group():
    assert run_name_default("tiny_arith", "/x/outputs/tiny_arith/2025-01-01_12-00-00/") == "tiny_arith/2025-01-01_12-00-00"
    assert run_name_default("", "/x/runs/a") == "a"
    assert multirun_group(None, True, "multirun/tiny_arith/2025-01-01_12-00-00") == "2025-01-01_12-00-00"
    assert multirun_group("mine", True, "multirun/t/2025") == "mine"
    assert multirun_group(None, False, "multirun/t/2025") is None
    assert hydra_wandb_group(None) is None and hydra_wandb_group("g") == "g"  # outside Hydra: as it is


@pytest.mark.slow  # a Hydra multirun in a subprocess: the full suite runs it
def test_a_hydra_multirun_is_one_wandb_group_and_a_single_run_none(tmp_path):
    """The launcher's job function (compose) sets the group: every job of a multirun the same."""
    (tmp_path / "app.py").write_text(textwrap.dedent("""
        import sys
        import hydra
        from omegaconf import OmegaConf
        from areal_flow.metrics.backends import hydra_wandb_group

        @hydra.main(version_base=None, config_path=None)
        def main(cfg):
            print("GROUP", hydra_wandb_group(cfg.get("group")), flush=True)

        main()
    """))
    # Microseconds in the sweep directory's name: each job must see the one the multirun made.
    dirs = ["hydra.sweep.dir=sweeps/${now:%H-%M-%S-%f}", "hydra.run.dir=single"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def app(*args):
        return subprocess.run([sys.executable, "app.py", *args, *dirs], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=60)

    multi, single = app("-m", "+x=1,2,3"), app("+x=1")
    groups = [line.split()[1] for line in multi.stdout.splitlines() if line.startswith("GROUP")]
    assert groups == [p.name for p in (tmp_path / "sweeps").iterdir()] * 3, multi.stdout + multi.stderr
    assert "GROUP None" in single.stdout, single.stdout + single.stderr


# ---- jsonl and the fan-out -----------------------------------------------------------------------

def test_jsonl_only_writes_metrics_jsonl_alone_and_rows_as_given(tmp_path):
    log_a_run(MetricsWriter(str(tmp_path / "metrics.jsonl"), MetricsConfig()))
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl"]
    rows = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert [r["event"] for r in rows] == ["start", "step", "step", "step", "eval", "summary"]
    assert rows[4]["samples"] == SAMPLES and rows[1]["staleness_hist"] == [4, 1, 0] and rows[1]["skipped"] is None


class Broken(Backend):
    def __init__(self):
        self.calls = 0

    def log(self, event, step, values):
        self.calls += 1
        raise RuntimeError("disk full")


def test_a_failing_backend_does_not_stop_the_run_and_is_reported_once(tmp_path, caplog):
    w = MetricsWriter(str(tmp_path / "metrics.jsonl"))
    broken = Broken()
    w._backends.append(broken)
    with caplog.at_level(logging.ERROR):
        for step in (1, 2, 3):
            w.log("step", step=step, reward=0.1)
    w.close()
    assert len(read_metrics(str(tmp_path / "metrics.jsonl"))) == 3 and broken.calls == 3
    (record,) = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert "Broken" in record.getMessage() and "disk full" in str(record.exc_info[1])


def test_a_backend_not_listed_is_not_imported(tmp_path):
    script = textwrap.dedent(f"""
        import json, sys
        from areal_flow.config.schema import MetricsConfig, WandbConfig
        from areal_flow.metrics.writer import MetricsWriter
        seen = []
        w = MetricsWriter({str(tmp_path / "a" / "metrics.jsonl")!r}, MetricsConfig())
        w.log("step", step=1, reward=0.5, staleness_hist=[1, 2])
        w.close()
        seen.append([m in sys.modules for m in ("wandb", "tensorboard", "torch.utils.tensorboard")])
        w = MetricsWriter({str(tmp_path / "b" / "metrics.jsonl")!r},
                          MetricsConfig(backends=["jsonl", "wandb"], wandb=WandbConfig(mode="disabled")))
        w.log("step", step=1, reward=0.5)
        w.close()
        seen.append([m in sys.modules for m in ("wandb", "tensorboard", "torch.utils.tensorboard")])
        print(json.dumps(seen))
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == [[False, False, False], [True, False, False]]


# ---- TensorBoard ---------------------------------------------------------------------------------

def accumulator(run_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    return acc


def text(acc, tag: str) -> tuple[int, str]:
    event = acc.Tensors(f"{tag}/text_summary")[-1]
    return event.step, event.tensor_proto.string_val[0].decode()


def test_tensorboard_writes_scalars_histograms_and_text(tmp_path):
    pytest.importorskip("tensorboard")
    log_a_run(MetricsWriter(str(tmp_path / "metrics.jsonl"), MetricsConfig(backends=["jsonl", "tensorboard"])))
    acc = accumulator(tmp_path)

    def scalars(tag):
        return [(e.step, round(e.value, 6)) for e in acc.Scalars(tag)]

    tags = acc.Tags()
    assert scalars("reward") == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert scalars("train/loss") == [(1, 1.0), (2, 0.5), (3, round(1 / 3, 6))]
    assert scalars("filtered") == [(1, 0.0), (2, 1.0), (3, 0.0)]
    assert scalars("eval/accuracy") == [(2, 0.75)] and scalars("eval/version") == [(2, 2.0)]
    assert scalars("eval/answer_versions/2") == [(2, 8.0)]
    assert not {"step", "skipped", "when", "length_hist_edges", "eval/step", "eval/when"} & set(tags["scalars"])
    assert set(tags["histograms"]) == {"staleness_hist", "length_hist"}

    h = acc.Histograms("staleness_hist")[-1]
    assert h.step == 3
    v = h.histogram_value
    assert list(v.bucket) == [4, 3, 0] and list(v.bucket_limit) == [0.5, 1.5, 2.5]
    assert (v.min, v.max, v.num, v.sum, v.sum_squares) == (-0.5, 1.5, 7, 3.0, 3.0)  # four 0s, three 1s
    v = acc.Histograms("length_hist")[0].histogram_value
    assert list(v.bucket) == [1, 2] and list(v.bucket_limit) == [8.0, 32.0] and (v.min, v.max) == (0.0, 32.0)
    assert v.sum == 1 * 4.0 + 2 * 20.0

    step, table = text(acc, "eval/samples")
    lines = table.splitlines()
    assert step == 2 and lines[0] == "| prompt | answer | reference | score |"
    assert lines[2] == "| 1+1= | 2 \\| two<br>lines | 2 | 1.0 |" and len(lines) == 4
    step, summary = text(acc, "summary")
    assert step == 3 and "| accuracy_end | 0.75 |" in summary and "| checkpoint | /runs/a/checkpoint |" in summary
    assert text(acc, "start")[0] == 0


def test_tensorboard_of_a_resumed_run_drops_the_rewound_steps(tmp_path):
    pytest.importorskip("tensorboard")
    path = tmp_path / "metrics.jsonl"
    cfg = MetricsConfig(backends=["jsonl", "tensorboard"])
    w = MetricsWriter(str(path), cfg)
    for step in (1, 2, 3, 4):
        w.log("step", step=step, reward=step / 10)
    w.close()
    path.write_text("".join(path.read_text().splitlines(keepends=True)[:2]))  # the checkpoint of step 2
    w = MetricsWriter(str(path), cfg)
    for step in (3, 4):
        w.log("step", step=step, reward=1.0)
    w.close()
    assert [(e.step, round(e.value, 6)) for e in accumulator(tmp_path).Scalars("reward")] == \
        [(1, 0.1), (2, 0.2), (3, 1.0), (4, 1.0)]


# ---- wandb ---------------------------------------------------------------------------------------

def wandb_records(run_dir: Path):
    """The records of the offline run's .wandb file: a LevelDB-style log (a 7-byte header, then
    32 KiB blocks of chunks: crc32, length, type FULL/FIRST/MIDDLE/LAST) of protobuf Records."""
    from wandb.proto import wandb_internal_pb2

    files = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    data = files[0].read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's trailer
            pos += block - pos % block
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        chunk = data[pos + 7:pos + 7 + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc
        pending, pos = pending + chunk, pos + 7 + length
        if kind in (1, 4):  # FULL, LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def history_rows(records) -> list[dict]:
    rows = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item})
    return rows


@pytest.mark.slow  # wandb's import and its offline service: ~1.5-3 s
def test_wandb_offline_run_holds_config_scalars_histograms_and_the_samples_table(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = MetricsConfig(backends=["jsonl", "wandb"],
                        wandb=WandbConfig(project="proj", group="sweep-1", tags=["a", "b"]))
    log_a_run(MetricsWriter(str(tmp_path / "metrics.jsonl"), cfg, run_name="tiny_arith",
                            config={"seed": 7, "rollout": {"max_staleness": 4}}))
    records = wandb_records(tmp_path)

    assert records[-1].WhichOneof("record_type") == "exit"  # close() waits for wandb to write it all
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.run_group, list(run.tags)) == ("proj", "sweep-1", ["a", "b"])
    assert run.display_name == f"tiny_arith/{tmp_path.name}"
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["seed"] == 7 and config["rollout"] == {"max_staleness": 4}

    rows = history_rows(records)
    steps = [r for r in rows if "step" in r]
    assert [(r["step"], r["reward"], r["train/loss"], r["n_groups"]) for r in steps] == \
        [(1, 0.1, 1.0, 2), (2, 0.2, 0.5, 4), (3, 0.3, 1 / 3, 6)]
    assert [r["filtered"] for r in steps] == [0, 1, 0] and not {"when", "skipped", "length_hist_edges"} & set(steps[0])
    assert steps[2]["staleness_hist/_type"] == "histogram" and steps[2]["staleness_hist/values"] == [4, 3, 0]
    assert steps[2]["staleness_hist/bins"] == [-0.5, 0.5, 1.5, 2.5]
    assert steps[0]["length_hist/values"] == [1, 2] and steps[0]["length_hist/bins"] == [0, 8, 32]

    (ev,) = [r for r in rows if "eval/step" in r]
    assert (ev["eval/step"], ev["eval/version"], ev["eval/accuracy"], ev["eval/answer_versions/2"]) == (2, 2, 0.75, 8)
    assert ev["eval/samples/_type"] == "table-file" and ev["eval/samples/nrows"] == 2
    assert ev["eval/samples/ncols"] == 4
    table = json.loads(next((tmp_path / "wandb").glob(f"offline-run-*/files/{ev['eval/samples/path']}")).read_text())
    assert table["columns"] == ["prompt", "answer", "reference", "score"] and table["data"][1] == ["2+2=", "5", "4", 0.0]

    # Each metric is plotted against its own row's step: an eval ending after later steps keeps its version.
    metrics = {r.metric.name: r.metric.step_metric for r in records if r.WhichOneof("record_type") == "metric"}
    assert metrics["reward"] == "step" and metrics["staleness_hist"] == "step"
    assert metrics["eval/accuracy"] == "eval/step" and metrics["eval/samples"] == "eval/step"

    summary = {item.key: json.loads(item.value_json) for r in records if r.WhichOneof("record_type") == "summary"
               for item in r.summary.update if item.key}
    assert summary["summary/steps"] == 3 and summary["summary/checkpoint"] == "/runs/a/checkpoint"
    assert summary["start/total_steps"] == 3


def test_wandb_disabled_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "run"
    cfg = MetricsConfig(backends=["jsonl", "wandb"], wandb=WandbConfig(mode="disabled"))
    w = MetricsWriter(str(run_dir / "metrics.jsonl"), cfg, run_name="t", config={"seed": 1})
    assert type(w._backends[0]).__name__ == "WandbBackend"
    log_a_run(w)
    assert sorted(os.listdir(run_dir)) == ["metrics.jsonl"] and sorted(os.listdir(tmp_path)) == ["run"]
