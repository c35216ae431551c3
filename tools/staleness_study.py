"""The staleness study (AReaL's Table 2 on tiny_arith): η × objective × seeds, a Hydra multirun per
objective, then a table with confidence intervals and significance tests, and a plot.

    python tools/staleness_study.py run [--etas 0 4 8] [--seeds 1 2 3 4 5] [--steps 40] [--dir DIR]
                                        [--objectives areal naive clip_behav ...] [--label TEXT]
                                        [--out MD] [--plot PNG] [-- overrides]
    python tools/staleness_study.py collect DIR [--label TEXT] [--out MD] [--plot PNG]

`run` launches `python -m areal_flow.launch -m` over rollout.max_staleness × seed for each objective
(OBJECTIVES: the project's default, AReaL's decoupled objective, naive PPO, and the corrections of
algorithm.correction) with the study's settings (STUDY: every run trains the same number of
samples), into one sweep directory (a later `run` into it adds to it), then collects.
`collect` reads every finished run of a sweep directory (its config.yaml, .hydra/overrides.yaml,
summary.json and metrics.jsonl; runs of the schema before algorithm.correction too) and writes, per
η and objective, the final held-out accuracy (mean ± 95% CI over seeds), wall time, trained
samples/s, realised staleness, tokens capped and the π_prox/π_behav mismatch; then Welch's t-tests
of each objective against `areal` at the same η and of each η > 0 against η = 0. The table goes to
--out (docs/staleness_study.md), the plot to --plot (docs/staleness_study.png).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import warnings
from collections import defaultdict
from pathlib import Path

import matplotlib
import yaml

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from _bench import machine, save_plot  # noqa: E402

from areal_flow.algorithms.correction_table import resolve  # noqa: E402
from areal_flow.config.schema import AlgorithmConfig  # noqa: E402
from areal_flow.metrics.writer import read_metrics  # noqa: E402

STUDY = [
    # Staleness must bite within a short run: four optimizer steps per update (the later
    # minibatches train further from π_behav).
    "algorithm.lr=1e-4", "algorithm.n_minibatches=4",
    # Interruption on: an update mid-answer leaves tokens of several versions in one answer.
    "rollout.interrupt=true", "rollout.max_concurrent=64",
    "max_wall_seconds=0", "eval.every_versions=0", "metrics.plot=false",
    # Every η decodes alike: batch-invariant decoding (on by default at η = 0) costs a fifth of the tokens/s.
    "generation.deterministic=false",
]

OBJECTIVES: dict[str, dict] = {
    "areal": {},  # the project's default: AReaL's decoupled objective, w masked above 5
    "naive": {"decoupled": False},  # PPO clipped against π_behav, no π_prox
    "clip_behav": {"clip_behav": True},  # decoupled, and naive PPO's clip against π_behav as well
    "tis": {"correction": "tis"},
    "mis": {"correction": "mis"},
    "mis_seq": {"correction": "mis", "correction_level": "sequence"},
    "icepop": {"correction": "icepop"},
    "m2po": {"correction": "m2po"},
    "mismatch_mask": {"correction": "mismatch_mask"},
    "vtrace": {"correction": "vtrace"},
    "cap2": {"behav_weight_cap": 2.0},  # AReaL's mask above 2 instead of 5
}
"""The objectives the study compares, by name: their algorithm settings that differ from the default's."""
BASELINE = "areal"
MIN_SEEDS = 5  # below this a cell's 95% CI is too wide for a t-test to say much: no verdict is stated
ALPHA = 0.05
RULE = "A difference is stated only where p < 0.05 with ≥ 5 seeds a cell."
OLD_DEFAULTS = {"clip_behav": False, "behav_weight_cap": 5.0, "behav_weight_floor": None,
                "behav_weight_action": "mask", "behav_weight_m2": None}
"""A setting's value in a run written before algorithm.correction, where its config.yaml lacks it
(clip_behav: a run from before clip_behav existed had AReaL's objective)."""


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
    collect(sweep, args.out, args.plot, shlex.join(sys.argv[1:]), args.label)


def from_old_schema(algorithm: dict) -> dict | None:
    """The settings of a run written before algorithm.correction, in today's keys; None where no
    correction of today's does what they did (e.g. the mask of M2PO on top of a cap other than 5)."""
    old = {k: algorithm.get(k, v) for k, v in OLD_DEFAULTS.items()}
    cap = math.inf if old["behav_weight_cap"] is None else old["behav_weight_cap"]  # null was "no cap" then
    floor, action, m2 = old["behav_weight_floor"], old["behav_weight_action"], old["behav_weight_m2"]
    new = {"clip_behav": old["clip_behav"], "correction_level": "token", "correction_tau": None}
    if m2 is not None:  # M2PO ran on top of the default mask above 5; today's m2po has no cap
        ok = action == "mask" and floor is None and cap == 5.0
        return new | {"correction": "m2po", "correction_tau": m2} if ok else None
    if action == "clamp":  # min(w, cap): V-trace's ρ̄
        return new | {"correction": "vtrace", "behav_weight_cap": cap} if floor is None else None
    # masked outside [floor, cap]: AReaL's; with a floor, IcePop's two-sided mask
    return new | {"correction": "areal" if floor is None else "icepop", "behav_weight_cap": cap,
                  "behav_weight_floor": floor}


def signature(algorithm: dict) -> tuple:
    """What makes a run's objective, with each correction's bounds resolved (null = its source's
    value), so that e.g. cap 5 set explicitly under areal reads as areal, and a bound the correction
    does not read makes no difference."""
    name = algorithm.get("correction") or "areal"
    params = resolve(name, low=algorithm.get("behav_weight_floor"), high=algorithm.get("behav_weight_cap"),
                     tau=algorithm.get("correction_tau"))
    level = algorithm.get("correction_level") or "token"
    return (bool(algorithm.get("clip_behav")), name, level if level in params.levels else "token",
            tuple((k, getattr(params, k)) for k in sorted(params.reads)))


def objective_of(algorithm: dict) -> str:
    """The OBJECTIVES name of a run's resolved `algorithm` settings (naive PPO whatever else it sets);
    "other" when none matches."""
    if not algorithm.get("decoupled", True):
        return "naive"
    if "correction" not in algorithm:  # written before algorithm.correction existed
        algorithm = from_old_schema(algorithm)
        if algorithm is None:
            return "other"
    try:
        have = signature(algorithm)
    except ValueError:  # a correction this tool does not know
        return "other"
    base = dataclasses.asdict(AlgorithmConfig())
    for name, settings in OBJECTIVES.items():
        if name != "naive" and have == signature(base | settings):
            return name
    return "other"


def step_mean(steps: list[dict], key: str) -> float | None:
    """A metric's mean over a run's step rows; None where no row has it (runs from before it existed)."""
    xs = [m[key] for m in steps if m.get(key) is not None]
    return statistics.fmean(xs) if xs else None


def read_run(run_dir: Path) -> dict:
    overrides = dict(o.split("=", 1) for o in yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text()))
    algorithm = yaml.safe_load((run_dir / "config.yaml").read_text())["algorithm"]
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = [m for m in read_metrics(str(run_dir / "metrics.jsonl")) if m["event"] == "step"]
    counts = [sum(m["staleness_hist"]) for m in steps]
    return {
        "eta": int(overrides["rollout.max_staleness"]),
        "objective": objective_of(algorithm),
        "capped": step_mean(steps, "train/capped_fraction"),
        "mismatch_abs": step_mean(steps, "train/mismatch/abs_mean"),
        "mismatch_k3": step_mean(steps, "train/mismatch/k3"),
        "seed": int(overrides["seed"]),
        "acc_start": summary["accuracy_start"],
        "acc_end": summary["accuracy_end"],
        "wall": summary["train_wall_seconds"],
        "samples_per_s": summary["samples_per_second"],
        "trained": summary["trained_samples"],
        "staleness_mean": sum(m["staleness_mean"] * c for m, c in zip(steps, counts)) / max(sum(counts), 1),
        "staleness_max": max((m["staleness_max"] for m in steps), default=0),
    }


def ci95(xs: list[float]) -> float:
    """Half-width of the 95% confidence interval of the mean of xs (Student t, n − 1 dof); nan for n < 2."""
    if len(xs) < 2:
        return math.nan
    from scipy import stats  # the study's only user of scipy ([dev]); the GPU machine collects this module without it

    return stats.t.ppf(0.975, len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))


def verdict(diff: float, p: float, n_a: int, n_b: int) -> str:
    if min(n_a, n_b) < MIN_SEEDS:
        return f"too few seeds (need ≥ {MIN_SEEDS})"
    if p < ALPHA:
        return "higher" if diff > 0 else "lower"
    return f"no difference found at n = {n_a}/{n_b} seeds"


def compare(a: list[float], b: list[float]) -> dict:
    """Welch's two-sample t-test of mean(a) against mean(b): the difference of means (a − b), its 95%
    Welch CI, t, the Welch–Satterthwaite dof, the two-sided p and the verdict ("higher": a's mean is).

    Both cells without spread (every seed alike, as a discrete accuracy can be) leave the t model no
    noise: equal means are no difference (p = 1, t = 0, where scipy gives nan); different means are
    certain (p = 0, t = ±inf, the CI the difference itself), which is what scipy 1.17 gives but is set
    here so that another scipy cannot turn it into nan."""
    from scipy import stats

    n_a, n_b = len(a), len(b)
    out = {"n_a": n_a, "n_b": n_b, "mean_a": statistics.fmean(a), "mean_b": statistics.fmean(b)}
    diff = out["mean_a"] - out["mean_b"]
    out |= {"diff": diff, "ci_low": math.nan, "ci_high": math.nan, "t": math.nan, "df": math.nan, "p": math.nan}
    if min(n_a, n_b) >= 2:
        if max(a) == min(a) and max(b) == min(b):
            t, p = (0.0, 1.0) if diff == 0 else (math.copysign(math.inf, diff), 0.0)
            out |= {"t": t, "p": p, "df": n_a + n_b - 2, "ci_low": diff, "ci_high": diff}
        else:
            va, vb = statistics.variance(a) / n_a, statistics.variance(b) / n_b
            df = (va + vb) ** 2 / (va ** 2 / (n_a - 1) + vb ** 2 / (n_b - 1))
            half = stats.t.ppf(0.975, df) * math.sqrt(va + vb)
            with warnings.catch_warnings():
                # one cell without spread makes scipy warn of precision loss; the other cell's
                # variance carries the test, and the result is right
                warnings.simplefilter("ignore", RuntimeWarning)
                res = stats.ttest_ind(a, b, equal_var=False)
            out |= {"t": float(res.statistic), "p": float(res.pvalue), "df": df,
                    "ci_low": diff - half, "ci_high": diff + half}
    out["verdict"] = verdict(diff, out["p"], n_a, n_b)
    return out


def fmt(x: float | None, spec: str, scale: float = 1.0, suffix: str = "") -> str:
    """x formatted, "-" where it is missing (a metric a run did not log, a CI of one seed)."""
    return "-" if x is None or math.isnan(x) else format(scale * x, spec) + suffix


def mean_of(rs: list[dict], key: str) -> float | None:
    xs = [r[key] for r in rs if r[key] is not None]
    return statistics.fmean(xs) if xs else None


def cell_lines(cells: dict[tuple[int, str], list[dict]]) -> list[str]:
    lines = ["| η | objective | seeds | final accuracy % (mean ± 95% CI) | wall s | trained samples/s (± 95% CI) "
             "| staleness mean / max | tokens capped | mismatch mean abs log w | mismatch k3 | samples |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (eta, objective), rs in cells.items():
        acc = [r["acc_end"] for r in rs]
        rate = [r["samples_per_s"] for r in rs]
        acc_text = f"{fmt(statistics.fmean(acc), '.1f', 100)} ± {fmt(ci95(acc), '.1f', 100)}"
        rate_text = f"{statistics.fmean(rate):.1f} ± {fmt(ci95(rate), '.1f')}"
        staleness = f"{statistics.fmean(r['staleness_mean'] for r in rs):.2f} / {max(r['staleness_max'] for r in rs)}"
        lines.append(f"| {eta} | {objective} | {len(rs)} | {acc_text} | {statistics.fmean(r['wall'] for r in rs):.0f} "
                     f"| {rate_text} | {staleness} | {fmt(mean_of(rs, 'capped'), '.2f', 100, '%')} "
                     f"| {fmt(mean_of(rs, 'mismatch_abs'), '.3g')} | {fmt(mean_of(rs, 'mismatch_k3'), '.3g')} "
                     f"| {rs[0]['trained']} |")
    return lines


def comparisons(cells: dict[tuple[int, str], list[dict]]) -> list[tuple[int, str, dict]]:
    """(η, what, compare()) for each objective against areal at its η, and each η > 0 against η = 0.
    "other" is left out: it may lump runs of different settings together."""
    acc = {key: [r["acc_end"] for r in rs] for key, rs in cells.items() if key[1] != "other"}
    out = []
    for eta in sorted({eta for eta, _ in acc}):
        for (e, objective), xs in acc.items():
            if e == eta and objective != BASELINE and (eta, BASELINE) in acc:
                out.append((eta, f"{objective} vs {BASELINE}", compare(xs, acc[(eta, BASELINE)])))
        for (e, objective), xs in acc.items():
            if e == eta and eta > 0 and (0, objective) in acc:
                out.append((eta, f"{objective}: η = {eta} vs η = 0", compare(xs, acc[(0, objective)])))
    return out


def comparison_lines(rows: list[tuple[int, str, dict]]) -> list[str]:
    lines = ["| η | comparison | seeds | difference (points) | 95% CI (Welch, points) | Welch t | p | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for eta, what, c in rows:
        p = c["p"]
        p_text = "-" if math.isnan(p) else "< 0.001" if p < 0.001 else f"{p:.3f}"
        ci = "-" if math.isnan(c["ci_low"]) else f"[{100 * c['ci_low']:+.1f}, {100 * c['ci_high']:+.1f}]"
        lines.append(f"| {eta} | {what} | {c['n_a']}/{c['n_b']} | {100 * c['diff']:+.1f} | {ci} "
                     f"| {fmt(c['t'], '+.2f')} | {p_text} | {c['verdict']} |")
    return lines


def legend(objectives: list[str]) -> str:
    parts = [f"{o}: " + (", ".join(overrides_of(o)) or "the defaults (AReaL's decoupled objective)")
             for o in objectives if o in OBJECTIVES]
    return "objectives (their algorithm overrides): " + "; ".join(parts)


def collect(sweep: Path, out: str, plot: str, command: str, label: str = "") -> None:
    runs = [read_run(p) for p in sorted(sweep.iterdir()) if (p / "summary.json").exists()]
    if not runs:
        raise SystemExit(f"{sweep}: no finished run (no */summary.json)")
    order = [*OBJECTIVES, "other"]
    cells: dict[tuple[int, str], list[dict]] = defaultdict(list)
    for r in sorted(runs, key=lambda r: (r["eta"], order.index(r["objective"]), r["seed"])):
        cells[(r["eta"], r["objective"])].append(r)
    starts = sorted({round(r["acc_start"], 4) for r in runs if r["acc_start"] is not None})
    lines = [f"machine: {machine()}", f"command: `python tools/staleness_study.py {command}`",
             f"regime: {label or '-'}", "",
             f"held-out accuracy at the start (every run): {', '.join(f'{100 * a:.1f}%' for a in starts)}", "",
             legend(list(dict.fromkeys(o for _, o in cells))), "",
             *cell_lines(cells), "", "## Comparisons", "",
             "Welch's t-test of the final held-out accuracy; the difference is the first named minus the second.", "",
             *comparison_lines(comparisons(cells)), "", RULE]
    text = "\n".join(lines)
    print("\n" + text)
    Path(out).write_text("# Staleness study: the table\n\nWritten by `tools/staleness_study.py`; "
                         "docs/benchmarks.md discusses it.\n\n" + text + "\n")
    plot_cells(cells, order, plot, label)
    print(f"table: {out}")


def plot_cells(cells: dict[tuple[int, str], list[dict]], order: list[str], plot: str, label: str) -> None:
    fig, (ax_acc, ax_rate) = plt.subplots(1, 2, figsize=(11, 4))
    present = [o for o in order if any(obj == o for _, obj in cells)]
    styles = {"areal": "d-", "naive": "s--", "clip_behav": "o-."}
    for i, objective in enumerate(present):
        mine = sorted((eta, rs) for (eta, o), rs in cells.items() if o == objective)
        # a small sideways shift per objective keeps the error bars of one η apart
        xs = [eta + 0.06 * (i - (len(present) - 1) / 2) for eta, _ in mine]
        accs = [[r["acc_end"] for r in rs] for _, rs in mine]
        half = [0.0 if math.isnan(ci95(a)) else 100 * ci95(a) for a in accs]
        style = styles.get(objective, "^:")
        ax_acc.errorbar(xs, [100 * statistics.fmean(a) for a in accs], yerr=half, fmt=style, capsize=3,
                        label=objective)
        ax_rate.plot([eta for eta, _ in mine], [statistics.fmean(r["samples_per_s"] for r in rs) for _, rs in mine],
                     style, label=objective)
    ax_acc.set(xlabel="η (max staleness)", ylabel="final held-out accuracy (%, 95% CI)", title="accuracy")
    ax_rate.set(xlabel="η (max staleness)", ylabel="trained samples / s", title="throughput")
    for ax in (ax_acc, ax_rate):
        ax.legend(fontsize="small")
        ax.grid(alpha=0.3)
    if label:
        fig.suptitle(label)
    save_plot(fig, plot)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the sweep, then collect it")
    r.add_argument("--etas", type=int, nargs="+", default=[0, 4, 8])
    r.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    r.add_argument("--steps", type=int, default=40)
    r.add_argument("--objectives", nargs="+", default=["areal", "naive", "clip_behav"], choices=list(OBJECTIVES))
    r.add_argument("--dir", help="the sweep directory (default multirun/staleness_study)")
    r.add_argument("overrides", nargs="*", help="more key=value overrides for every run")
    c = sub.add_parser("collect", help="collect a finished (or partial) sweep")
    c.add_argument("dir")
    for p in (r, c):
        p.add_argument("--out", default="docs/staleness_study.md")
        p.add_argument("--plot", default="docs/staleness_study.png")
        p.add_argument("--label", default="", help="the regime, in words, at the top of the table "
                       "(e.g. \"staleness realised (algorithm.success_rate_range=null)\")")
    return ap


def main() -> None:
    args = parser().parse_args()
    if args.cmd == "run":
        run(args)
    else:
        collect(Path(args.dir), args.out, args.plot, shlex.join(sys.argv[1:]), args.label)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
