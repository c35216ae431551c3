"""tools/staleness_study.py's bookkeeping: which objective a run is (today's schema and the one before
algorithm.correction), its statistics against hand-computed values, and the table and plot of a
sweep directory (hand-built runs in the layout a Hydra multirun of the launcher writes)."""

import dataclasses
import json
import math
import statistics
import sys
import warnings
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import staleness_study  # noqa: E402
from staleness_study import OBJECTIVES, ci95, collect, compare, objective_of, overrides_of, parser  # noqa: E402

from areal_flow.config.schema import AlgorithmConfig  # noqa: E402

NEW = dataclasses.asdict(AlgorithmConfig())
OLD = {k: v for k, v in NEW.items() if k not in ("correction", "correction_level", "correction_tau")} | {
    "clip_behav": True, "behav_weight_cap": 5.0, "behav_weight_floor": None, "behav_weight_action": "mask",
    "behav_weight_m2": None}
"""A run's algorithm section as the schema before algorithm.correction resolved it, at its defaults."""

# Two-sided 97.5% quantiles of Student's t from a printed table (not scipy).
T975 = {4: 2.776445105, 8: 2.306004135}


def t_two_sided_p(t: float, df: float) -> float:
    """Two-sided p of Student's t by Simpson's rule on its density: independent of scipy."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    pdf = lambda x: c * (1 + x * x / df) ** (-(df + 1) / 2)  # noqa: E731
    n, h = 4000, abs(t) / 4000
    area = h / 3 * sum(pdf(i * h) * (1 if i in (0, n) else 4 if i % 2 else 2) for i in range(n + 1))
    return 1 - 2 * area


def test_each_objectives_settings_read_back_as_that_objective():
    for name in OBJECTIVES:
        algorithm = dict(NEW)
        for o in overrides_of(name):  # what the launcher would resolve from the overrides
            key, value = o.removeprefix("algorithm.").split("=", 1)
            assert key in NEW, f"{name}: algorithm.{key} is no setting of AlgorithmConfig"
            algorithm[key] = yaml.safe_load(value)
        assert objective_of(algorithm) == name
    assert overrides_of("mis_seq") == ["algorithm.correction=mis", "algorithm.correction_level=sequence"]
    assert overrides_of("areal") == []
    # naive PPO whatever else is set
    assert objective_of(NEW | {"decoupled": False, "correction": "m2po"}) == "naive"
    # a bound set to the correction's own default, or one it does not read, is still that correction
    assert objective_of(NEW | {"behav_weight_cap": 5.0}) == "areal"
    assert objective_of(NEW | {"correction": "tis", "behav_weight_floor": 0.3}) == "tis"
    assert objective_of(NEW | {"correction": "tis", "correction_level": "sequence"}) == "other"
    assert objective_of(NEW | {"behav_weight_cap": 3.0}) == "other"
    assert objective_of(NEW | {"behav_weight_floor": 0.5}) == "other"  # areal's mask with a floor is not icepop
    assert objective_of(NEW | {"correction": "m2po", "correction_tau": 0.1}) == "other"
    assert objective_of(NEW | {"correction": "a_future_one"}) == "other"


def test_runs_of_the_schema_before_correction_read_as_todays_objectives():
    areal = OLD | {"clip_behav": False}
    assert objective_of(OLD) == "clip_behav"  # that schema's default
    assert objective_of(areal) == "areal"
    assert objective_of({k: v for k, v in OLD.items() if k != "clip_behav"}) == "areal"  # before clip_behav
    assert objective_of(areal | {"behav_weight_floor": 0.5}) == "icepop"
    assert objective_of(areal | {"behav_weight_m2": 0.04}) == "m2po"
    assert objective_of(areal | {"behav_weight_cap": 1.0, "behav_weight_action": "clamp"}) == "vtrace"
    assert objective_of(areal | {"behav_weight_cap": 2.0}) == "cap2"
    assert objective_of(OLD | {"decoupled": False}) == "naive"
    for other in ({"behav_weight_action": "clamp"},  # clamp at 5: V-trace with ρ̄ = 5, no objective of the study
                  {"behav_weight_cap": None},  # no cap
                  {"behav_weight_m2": 0.04, "behav_weight_cap": 2.0},
                  {"behav_weight_m2": 0.04, "clip_behav": True},
                  {"behav_weight_floor": 0.3},
                  {"behav_weight_floor": 0.5, "behav_weight_action": "clamp"}):
        assert objective_of(areal | other) == "other", other


def test_ci95_is_students_t_half_width():
    assert ci95([1, 2, 3, 4, 5]) == pytest.approx(T975[4] * math.sqrt(2.5) / math.sqrt(5), rel=1e-8)
    assert ci95([0.5, 0.5, 0.5]) == 0.0
    assert math.isnan(ci95([0.5]))


def test_compare_is_welchs_t_test():
    # equal spread: t = -2 on 8 dof, p = 0.0805 (printed tables), CI −2 ± t(0.975, 8)
    c = compare([1, 2, 3, 4, 5], [3, 4, 5, 6, 7])
    assert (c["diff"], c["t"], c["n_a"], c["n_b"]) == (pytest.approx(-2), pytest.approx(-2), 5, 5)
    assert c["df"] == pytest.approx(8)
    assert c["p"] == pytest.approx(t_two_sided_p(-2, 8), rel=1e-6) == pytest.approx(0.0805, abs=1e-4)
    assert (c["ci_low"], c["ci_high"]) == (pytest.approx(-2 - T975[8]), pytest.approx(-2 + T975[8]))
    assert c["verdict"] == "no difference found at n = 5/5 seeds"
    # unequal spread and sizes: Welch–Satterthwaite's dof, not n_a + n_b − 2
    a, b = [2, 4, 6, 8, 10, 12], [1, 2, 3]
    va, vb = statistics.variance(a) / 6, statistics.variance(b) / 3
    t = (7 - 2) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va ** 2 / 5 + vb ** 2 / 2)
    c = compare(a, b)
    assert (c["t"], c["df"]) == (pytest.approx(t), pytest.approx(df))
    assert c["p"] == pytest.approx(t_two_sided_p(t, df), rel=1e-6)
    assert c["p"] < 0.05 and c["verdict"] == "too few seeds (need ≥ 5)"  # significant, but 3 seeds
    # clearly separated, 5 seeds each
    assert compare([.60, .61, .62, .63, .64], [.40, .41, .42, .43, .44])["verdict"] == "higher"
    assert compare([.40, .41, .42, .43, .44], [.60, .61, .62, .63, .64])["verdict"] == "lower"


def test_compare_without_spread():
    same = compare([0.5] * 5, [0.5] * 5)
    assert (same["p"], same["t"], same["verdict"]) == (1.0, 0.0, "no difference found at n = 5/5 seeds")
    apart = compare([0.5] * 5, [0.6] * 5)
    assert (apart["p"], apart["t"], apart["verdict"]) == (0.0, -math.inf, "lower")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one constant cell: scipy's precision warning stays inside
        one = compare([0.5] * 5, [0.6, 0.6, 0.6, 0.6, 0.61])
    assert one["df"] == pytest.approx(4)  # Welch's dof: the spread cell's n − 1
    assert one["verdict"] == "lower"
    assert math.isnan(compare([0.5], [0.6, 0.7])["p"])


def test_the_cli_defaults():
    args = parser().parse_args(["run"])
    assert (args.etas, args.seeds, args.objectives) == ([0, 4, 8], [1, 2, 3, 4, 5], ["areal", "naive", "clip_behav"])
    args = parser().parse_args(["collect", "d", "--label", "recipe's regime"])
    assert (args.dir, args.label) == ("d", "recipe's regime")


def run_dir(root: Path, name: str, algorithm: dict, eta: int, seed: int, acc_end: float, capped: float | None,
            mismatch: tuple[float, float] | None = None) -> None:
    d = root / name
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"rollout.max_staleness={eta}", f"seed={seed}"]))
    (d / "config.yaml").write_text(yaml.safe_dump({"algorithm": algorithm}))
    (d / "summary.json").write_text(json.dumps({"accuracy_start": 0.4, "accuracy_end": acc_end,
                                                "train_wall_seconds": 10.0, "samples_per_second": 100.0,
                                                "trained_samples": 640}))
    rows = [{"event": "step", "step": s, "staleness_hist": [10, 30], "staleness_mean": 0.75, "staleness_max": 1,
             "train/capped_fraction": capped} for s in (1, 2)]
    if mismatch:
        for row, scale in zip(rows, (0.5, 1.5)):  # the run's mean is the given value
            row |= {"train/mismatch/abs_mean": scale * mismatch[0], "train/mismatch/k3": scale * mismatch[1]}
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_collect_writes_cells_and_comparisons(tmp_path, monkeypatch):
    monkeypatch.setattr(staleness_study, "machine", lambda: "test machine")
    sweep = tmp_path / "sweep"
    cells = {  # (η, name prefix, algorithm section): final accuracies by seed
        (0, "a", json.dumps(NEW)): [.50, .52, .51, .53, .49],
        (0, "n", json.dumps(NEW | {"decoupled": False})): [.30, .31, .32, .29, .30],  # clearly lower
        (0, "c", json.dumps(OLD)): [.52, .49, .53, .50, .54],  # an old-schema run: clip_behav; overlaps areal
        (0, "t", json.dumps(NEW | {"correction": "tis"})): [.20, .30, .25],  # 3 seeds
        (0, "o", json.dumps(NEW | {"behav_weight_cap": 3.0})): [.10] * 5,  # "other": no comparison
        (8, "a", json.dumps(NEW)): [.60, .62, .61, .63, .59],  # higher than at η = 0
    }
    for (eta, prefix, algorithm), accs in cells.items():
        for seed, acc in enumerate(accs, 1):
            mismatch = (0.01, 0.002) if prefix == "a" else None
            run_dir(sweep, f"{prefix}{eta}-{seed}", json.loads(algorithm), eta, seed, acc, 0.01, mismatch)
    (sweep / "unfinished").mkdir()  # a run still going: no summary.json, not counted
    (sweep / "multirun.yaml").write_text("{}")
    out = tmp_path / "table.md"
    collect(sweep, str(out), str(tmp_path / "plot.png"), "collect sweep", label="test regime")
    text = out.read_text()
    lines = text.splitlines()
    assert lines[0] == "# Staleness study: the table"
    assert "machine: test machine" in lines and "regime: test regime" in lines
    assert "held-out accuracy at the start (every run): 40.0%" in lines
    cell_rows = [line for line in lines if line.startswith(("| 0 |", "| 8 |")) and "vs" not in line]
    assert cell_rows == [
        "| 0 | areal | 5 | 51.0 ± 2.0 | 10 | 100.0 ± 0.0 | 0.75 / 1 | 1.00% | 0.01 | 0.002 | 640 |",
        "| 0 | naive | 5 | 30.4 ± 1.4 | 10 | 100.0 ± 0.0 | 0.75 / 1 | 1.00% | - | - | 640 |",
        "| 0 | clip_behav | 5 | 51.6 ± 2.6 | 10 | 100.0 ± 0.0 | 0.75 / 1 | 1.00% | - | - | 640 |",
        "| 0 | tis | 3 | 25.0 ± 12.4 | 10 | 100.0 ± 0.0 | 0.75 / 1 | 1.00% | - | - | 640 |",
        "| 0 | other | 5 | 10.0 ± 0.0 | 10 | 100.0 ± 0.0 | 0.75 / 1 | 1.00% | - | - | 640 |",
        "| 8 | areal | 5 | 61.0 ± 2.0 | 10 | 100.0 ± 0.0 | 0.75 / 1 | 1.00% | 0.01 | 0.002 | 640 |"]
    verdicts = {line.split(" | ")[1]: line.split(" | ")[-1].rstrip(" |") for line in lines if " vs " in line}
    assert verdicts == {"naive vs areal": "lower",
                        "clip_behav vs areal": "no difference found at n = 5/5 seeds",
                        "tis vs areal": "too few seeds (need ≥ 5)",
                        "areal: η = 8 vs η = 0": "higher"}
    naive = next(line for line in lines if "naive vs areal" in line)
    assert "| 5/5 | -20.6 |" in naive
    assert lines[-1] == "A difference is stated only where p < 0.05 with ≥ 5 seeds a cell."
    assert text.index("## Comparisons") > text.index("| 8 | areal | 5 |")
    assert (tmp_path / "plot.png").stat().st_size > 0
