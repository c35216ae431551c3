"""tools/staleness_study.py's bookkeeping: which objective a run is, and the table and plot of a
sweep directory (hand-built runs in the layout a Hydra multirun of the launcher writes)."""

import json
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import staleness_study  # noqa: E402
from staleness_study import OBJECTIVES, collect, objective_of  # noqa: E402


def test_each_objectives_overrides_read_back_as_that_objective():
    for name, settings in OBJECTIVES.items():
        overrides = dict(o.split("=", 1) for o in settings + ["seed=1", "rollout.max_staleness=8"])
        assert objective_of(overrides) == name
    # naive PPO whatever else is set; nothing said is the default objective
    assert objective_of({"algorithm.decoupled": "False", "algorithm.behav_weight_m2": "0.04"}) == "naive"
    assert objective_of({"seed": "3"}) == "decoupled"
    assert objective_of({"algorithm.clip_behav": "True"}) == "clip_behav"  # as a multirun writes it back


def run_dir(root: Path, name: str, overrides: list[str], acc_end: float, capped: float | None) -> None:
    d = root / name
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (d / "summary.json").write_text(json.dumps({"accuracy_start": 0.4, "accuracy_end": acc_end, "train_wall_seconds": 10.0,
                                                "samples_per_second": 100.0, "trained_samples": 640}))
    rows = [{"event": "step", "step": s, "staleness_hist": [10, 30], "staleness_mean": 0.75, "staleness_max": 1,
             "train/capped_fraction": capped} for s in (1, 2)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_collect_gives_a_row_per_eta_and_objective_with_the_seeds_spread(tmp_path, monkeypatch):
    monkeypatch.setattr(staleness_study, "machine", lambda: "test machine")
    sweep = tmp_path / "sweep"
    for seed, acc in ((1, 0.5), (2, 0.7)):
        run_dir(sweep, f"d{seed}", ["rollout.max_staleness=8", "algorithm.decoupled=true", f"seed={seed}"], acc, 0.01)
        run_dir(sweep, f"n{seed}", ["rollout.max_staleness=8", "algorithm.decoupled=false", f"seed={seed}"], acc - 0.1, None)
    run_dir(sweep, "m1", ["rollout.max_staleness=8", "algorithm.decoupled=true", "algorithm.behav_weight_m2=0.04",
                          "seed=1"], 0.2, 0.03)
    out = tmp_path / "table.md"
    collect(sweep, str(out), str(tmp_path / "plot.png"), "run --etas 8")
    rows = [line for line in out.read_text().splitlines() if line.startswith("| 8 |")]
    assert rows == ["| 8 | decoupled (default) | 2 | 60.0 ± 14.1% | 10 | 100.0 ± 0.0 | 0.75 / 1 | 1.00% | 640 |",
                    "| 8 | naive PPO | 2 | 50.0 ± 14.1% | 10 | 100.0 ± 0.0 | 0.75 / 1 | - | 640 |",
                    "| 8 | m2po | 1 | 20.0 ± 0.0% | 10 | 100.0 ± 0.0 | 0.75 / 1 | 3.00% | 640 |"]
    assert (tmp_path / "plot.png").stat().st_size > 0
