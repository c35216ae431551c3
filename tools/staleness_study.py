"""The staleness study (AReaL's Table 2 on tiny_arith): η × objective × seeds, a Hydra multirun per
objective, then a table and a plot.

    python tools/staleness_study.py run [--etas 0 1 2 4 8] [--seeds 1 2] [--steps 40] [--dir DIR]
                                        [--objectives default naive ...] [-- overrides]
    python tools/staleness_study.py collect DIR

`run` launches `python -m areal_flow.launch -m` over rollout.max_staleness × seed for each objective
(OBJECTIVES: the project's default, AReaL's decoupled objective, naive PPO, and the candidates of
docs/algorithms.md)
with the study's settings (STUDY: every run trains the same number of samples), into one sweep
directory (a later `run` into it adds to it), then collects.
`collect` reads every run of a sweep directory (its config.yaml, .hydra/overrides.yaml, summary.json
and metrics.jsonl) and prints, per η and objective, the final held-out accuracy (mean ± std over
seeds), wall time, trained samples/s and realised staleness; it writes the table to
docs/staleness_study.md and the plot to docs/staleness_study.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib
import yaml

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from _bench import machine, save_plot  # noqa: E402

from areal_flow.config.schema import AlgorithmConfig  # noqa: E402
from areal_flow.metrics.writer import read_metrics  # noqa: E402

STUDY = [
    # Staleness must bite within a short run: a higher learning rate than the recipe's 1e-4 and
    # four optimizer steps per update (the later minibatches train further from π_behav).
    "algorithm.lr=1e-4", "algorithm.n_minibatches=4",
    # Interruption on: an update mid-answer leaves tokens of several versions in one answer.
    "rollout.interrupt=true", "rollout.max_concurrent=64",
    "max_wall_seconds=0", "eval.every_versions=0", "metrics.plot=false",
    # Every η decodes alike: batch-invariant decoding (on by default at η = 0) costs a fifth of the tokens/s.
    "generation.deterministic=false",
]


AREAL = {"clip_behav": False}  # AReaL's decoupled objective: the behaviour weight, no clip against π_behav
OBJECTIVES: dict[str, dict] = {
    "default": {},  # the project's default: decoupled, weight masked above 5, naive PPO's clip as well
    "areal": AREAL,
    "naive": {"decoupled": False},  # PPO clipped against π_behav, no π_prox
    "m2po": AREAL | {"behav_weight_m2": 0.04},  # M2PO's second-moment mask
    "icepop": AREAL | {"behav_weight_floor": 0.5},  # two-sided mask [0.5, 5]
    "clamp": AREAL | {"behav_weight_action": "clamp"},  # clamp at 5, not mask
    "cap2": AREAL | {"behav_weight_cap": 2.0},  # mask above 2
    # truncated importance weights as V-trace's ρ̄ = 1: a stale token is weighted down, never up
    "clamp1": AREAL | {"behav_weight_cap": 1.0, "behav_weight_action": "clamp"},
}
"""The objectives the study compares, by name: their algorithm settings that differ from the default's."""
BASE = {name: getattr(AlgorithmConfig(), name) for name in
        ("decoupled", "clip_behav", "behav_weight_cap", "behav_weight_floor", "behav_weight_action", "behav_weight_m2")}
"""The settings that tell the objectives apart, at their defaults."""
OLD_DEFAULTS = {"clip_behav": False}
"""What a run written before a setting existed had instead (clip_behav: AReaL's objective until 2026-11-28)."""
LABELS = {"default": "default (clip_behav)", "areal": "decoupled (AReaL)", "naive": "naive PPO"}


def overrides_of(objective: str) -> list[str]:
    """The launcher overrides that make an objective."""
    return [f"algorithm.{k}={'null' if v is None else str(v).lower()}" for k, v in OBJECTIVES[objective].items()]


def run(args: argparse.Namespace) -> None:
    sweep = Path(args.dir or "multirun/staleness_study").resolve()
    for objective in args.objectives:
        cmd = [sys.executable, "-m", "areal_flow.launch", "-m",
               "rollout.max_staleness=" + ",".join(map(str, args.etas)), *overrides_of(objective),
               "seed=" + ",".join(map(str, args.seeds)), f"total_steps={args.steps}", *STUDY, *args.overrides,
               f"hydra.sweep.dir={sweep}"]
        print("$", " ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, check=True)
    collect(sweep, args.out, args.plot, " ".join(sys.argv[1:]))


def objective_of(algorithm: dict) -> str:
    """The OBJECTIVES name of a run's resolved `algorithm` settings (naive PPO whatever else it sets);
    "other" when none matches."""
    if not algorithm.get("decoupled", True):
        return "naive"
    have = {k: algorithm.get(k, OLD_DEFAULTS.get(k, v)) for k, v in BASE.items()}
    for name, settings in OBJECTIVES.items():
        if have == BASE | settings:
            return name
    return "other"


def read_run(run_dir: Path) -> dict:
    overrides = dict(o.split("=", 1) for o in yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text()))
    algorithm = yaml.safe_load((run_dir / "config.yaml").read_text())["algorithm"]
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = [m for m in read_metrics(str(run_dir / "metrics.jsonl")) if m["event"] == "step"]
    counts = [sum(m["staleness_hist"]) for m in steps]
    capped = [m["train/capped_fraction"] for m in steps if m.get("train/capped_fraction") is not None]
    return {
        "eta": int(overrides["rollout.max_staleness"]),
        "objective": objective_of(algorithm),
        "capped": statistics.fmean(capped) if capped else None,
        "seed": int(overrides["seed"]),
        "acc_start": summary["accuracy_start"],
        "acc_end": summary["accuracy_end"],
        "wall": summary["train_wall_seconds"],
        "samples_per_s": summary["samples_per_second"],
        "trained": summary["trained_samples"],
        "staleness_mean": sum(m["staleness_mean"] * c for m, c in zip(steps, counts)) / max(sum(counts), 1),
        "staleness_max": max(m["staleness_max"] for m in steps),
    }


def mean_std(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0


def collect(sweep: Path, out: str, plot: str, command: str) -> None:
    runs = [read_run(p) for p in sorted(sweep.iterdir()) if (p / "summary.json").exists()]
    if not runs:
        raise SystemExit(f"{sweep}: no finished run (no */summary.json)")
    cells: dict[tuple[int, str], list[dict]] = defaultdict(list)
    for r in runs:
        cells[(r["eta"], r["objective"])].append(r)
    order = [*OBJECTIVES, "other"]
    starts = sorted({round(r["acc_start"], 4) for r in runs if r["acc_start"] is not None})
    lines = [f"machine: {machine()}", f"command: python tools/staleness_study.py {command}", "",
             f"held-out accuracy at the start (every run): {', '.join(f'{100 * a:.1f}%' for a in starts)}", "",
             "| η | objective | seeds | final accuracy | wall s | trained samples/s | staleness mean / max "
             "| tokens capped | samples |",
             "|---|---|---|---|---|---|---|---|---|"]
    rows = []
    for (eta, objective), rs in sorted(cells.items(), key=lambda kv: (kv[0][0], order.index(kv[0][1]))):
        acc, acc_sd = mean_std([r["acc_end"] for r in rs])
        wall, _ = mean_std([r["wall"] for r in rs])
        rate, rate_sd = mean_std([r["samples_per_s"] for r in rs])
        rows.append({"eta": eta, "objective": objective, "acc": acc, "acc_sd": acc_sd, "rate": rate})
        capped = [r["capped"] for r in rs if r["capped"] is not None]
        lines.append(f"| {eta} | {LABELS.get(objective, objective)} | {len(rs)} | "
                     f"{100 * acc:.1f} ± {100 * acc_sd:.1f}% | {wall:.0f} | {rate:.1f} ± {rate_sd:.1f} | "
                     f"{statistics.fmean(r['staleness_mean'] for r in rs):.2f} / {max(r['staleness_max'] for r in rs)} | "
                     f"{f'{100 * statistics.fmean(capped):.2f}%' if capped else '-'} | {rs[0]['trained']} |")
    text = "\n".join(lines)
    print("\n" + text)
    Path(out).write_text("# Staleness study: the table\n\nWritten by `tools/staleness_study.py`; "
                         "docs/benchmarks.md discusses it.\n\n" + text + "\n")
    fig, (ax_acc, ax_rate) = plt.subplots(1, 2, figsize=(10, 3.8))
    styles = {"default": "o-", "areal": "d-.", "naive": "s--"}
    for objective in (o for o in order if any(r["objective"] == o for r in rows)):
        mine = [r for r in rows if r["objective"] == objective]
        style = styles.get(objective, "^:") if len(mine) > 1 else styles.get(objective, "^")
        label = LABELS.get(objective, objective)
        ax_acc.errorbar([r["eta"] for r in mine], [100 * r["acc"] for r in mine],
                        yerr=[100 * r["acc_sd"] for r in mine], fmt=style, capsize=3, label=label)
        ax_rate.plot([r["eta"] for r in mine], [r["rate"] for r in mine], style, label=label)
    ax_acc.set(xlabel="η (max staleness)", ylabel="final held-out accuracy (%)", title="accuracy")
    ax_rate.set(xlabel="η (max staleness)", ylabel="trained samples / s", title="throughput")
    for ax in (ax_acc, ax_rate):
        ax.legend()
        ax.grid(alpha=0.3)
    save_plot(fig, plot)
    print(f"table: {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the sweep, then collect it")
    r.add_argument("--etas", type=int, nargs="+", default=[0, 1, 2, 4, 8])
    r.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    r.add_argument("--steps", type=int, default=40)
    r.add_argument("--objectives", nargs="+", default=["default", "naive"], choices=list(OBJECTIVES))
    r.add_argument("--dir", help="the sweep directory (default multirun/staleness_study)")
    r.add_argument("overrides", nargs="*", help="more key=value overrides for every run")
    c = sub.add_parser("collect", help="collect a finished (or partial) sweep")
    c.add_argument("dir")
    for p in (r, c):
        p.add_argument("--out", default="docs/staleness_study.md")
        p.add_argument("--plot", default="docs/staleness_study.png")
    args = ap.parse_args()
    if args.cmd == "run":
        run(args)
    else:
        collect(Path(args.dir), args.out, args.plot, " ".join(sys.argv[1:]))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
