"""tools/staleness_study.py's bookkeeping: which objective a run is, and the table and plot of a
sweep directory (hand-built runs in the layout a Hydra multirun of the launcher writes)."""

import dataclasses
import json
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import staleness_study  # noqa: E402
from staleness_study import OBJECTIVES, collect, objective_of, overrides_of  # noqa: E402

from areal_flow.config.schema import AlgorithmConfig  # noqa: E402


def test_each_objectives_settings_read_back_as_that_objective():
    for name in OBJECTIVES:
        algorithm = dataclasses.asdict(AlgorithmConfig())
        for o in overrides_of(name):  # what the launcher would resolve from the overrides
            key, value = o.removeprefix("algorithm.").split("=", 1)
            algorithm[key] = yaml.safe_load(value)
        assert objective_of(algorithm) == name
    # naive PPO whatever else is set; a run from before clip_behav existed had AReaL's objective
    assert objective_of({"decoupled": False, "behav_weight_m2": 0.04}) == "naive"
    old = dataclasses.asdict(AlgorithmConfig())
    del old["clip_behav"]
    assert objective_of(old) == "areal"
    assert objective_of(dataclasses.asdict(AlgorithmConfig()) | {"behav_weight_cap": 3.0}) == "other"


def run_dir(root: Path, name: str, algorithm: dict, eta: int, seed: int, acc_end: float, capped: float | None) -> None:
    d = root / name
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"rollout.max_staleness={eta}", f"seed={seed}"]))
    (d / "config.yaml").write_text(yaml.safe_dump({"algorithm": dataclasses.asdict(AlgorithmConfig()) | algorithm}))
    (d / "summary.json").write_text(json.dumps({"accuracy_start": 0.4, "accuracy_end": acc_end, "train_wall_seconds": 10.0,
                                                "samples_per_second": 100.0, "trained_samples": 640}))
    rows = [{"event": "step", "step": s, "staleness_hist": [10, 30], "staleness_mean": 0.75, "staleness_max": 1,
             "train/capped_fraction": capped} for s in (1, 2)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_collect_gives_a_row_per_eta_and_objective_with_the_seeds_spread(tmp_path, monkeypatch):
    monkeypatch.setattr(staleness_study, "machine", lambda: "test machine")
    sweep = tmp_path / "sweep"
    for seed, acc in ((1, 0.5), (2, 0.7)):
        run_dir(sweep, f"d{seed}", {}, 8, seed, acc, 0.01)
        run_dir(sweep, f"n{seed}", {"decoupled": False}, 8, seed, acc - 0.1, None)
    run_dir(sweep, "m1", {"clip_behav": False, "behav_weight_m2": 0.04}, 8, 1, 0.2, 0.03)
    out = tmp_path / "table.md"
    collect(sweep, str(out), str(tmp_path / "plot.png"), "run --etas 8")
    rows = [line for line in out.read_text().splitlines() if line.startswith("| 8 |")]
    assert rows == ["| 8 | default (clip_behav) | 2 | 60.0 ± 14.1% | 10 | 100.0 ± 0.0 | 0.75 / 1 | 1.00% | 640 |",
                    "| 8 | naive PPO | 2 | 50.0 ± 14.1% | 10 | 100.0 ± 0.0 | 0.75 / 1 | - | 640 |",
                    "| 8 | m2po | 1 | 20.0 ± 0.0% | 10 | 100.0 ± 0.0 | 0.75 / 1 | 3.00% | 640 |"]
    assert (tmp_path / "plot.png").stat().st_size > 0
