"""python -m areal_flow.advise: simulate candidate allocations and recommend one (docs/advise.md).

    python -m areal_flow.advise --preset areal_1.5b
    python -m areal_flow.advise --from-run outputs/tiny_arith/RUN --splits 1:1 --etas 0 1 4
    python -m areal_flow.advise --costs my_costs.yaml --devices 64 --splits 3:1 1:1 --etas 0 2 8 --no-colocated
    python -m areal_flow.advise --costs my_costs.yaml --devices 1 --etas 0 1 2   # one device: colocated only
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

from rich.console import Console

from areal_flow.advise.cost_file import load_cost_file, parse_costs, parse_split, read_lengths_file
from areal_flow.advise.costs import AdviseError, Candidates, Costs, Lengths
from areal_flow.advise.fit import fit_runs
from areal_flow.advise.prediction import Candidate, Prediction
from areal_flow.advise.report import costs_table, plot, predictions_table, recommend
from areal_flow.advise.simulate import simulate

# An installed wheel holds conf/ inside the package; a checkout has it at the top of the repository.
PRESET_DIRS = (Path(__file__).resolve().parents[1] / "conf" / "advise", Path(__file__).resolve().parents[2] / "conf" / "advise")


def presets() -> dict[str, Path]:
    """Preset name -> cost file, from conf/advise/."""
    found: dict[str, Path] = {}
    for d in PRESET_DIRS:
        for f in sorted(d.glob("*.yaml")) if d.is_dir() else ():
            found.setdefault(f.stem, f)
    return found


def _bool(text: str) -> bool:
    if text.lower() in ("true", "yes", "1"):
        return True
    if text.lower() in ("false", "no", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _eta(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"η must be an integer ≥ 0, got {text!r}")
    return value


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m areal_flow.advise", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[2:]))
    source = ap.add_mutually_exclusive_group()
    source.add_argument("--costs", metavar="FILE", help="cost file (YAML or JSON; conf/advise/example.yaml)")
    source.add_argument("--preset", metavar="NAME", help=f"a cost file of conf/advise/: {', '.join(presets())}")
    ap.add_argument("--from-run", nargs="+", metavar="RUN_DIR", help="fit the costs from these runs' metrics.jsonl "
                    "(what cannot be fitted comes from --costs/--preset)")
    ap.add_argument("--splits", nargs="+", metavar="GEN:TRAIN", help="devices for generation:training (ratios of "
                    "--devices when given), e.g. 3:1 1:1")
    ap.add_argument("--devices", type=_positive, help="total devices: each split is a ratio of them")
    ap.add_argument("--etas", nargs="+", type=_eta, metavar="η", help="values of rollout.max_staleness, e.g. 0 1 2 4 8")
    ap.add_argument("--batch", type=_positive, help="prompt groups per step (algorithm.batch_size)")
    ap.add_argument("--group-size", type=_positive, help="answers per prompt (algorithm.group_size)")
    ap.add_argument("--max-concurrent", type=_positive, help="most groups generating at once (rollout.max_concurrent)")
    ap.add_argument("--interrupt", nargs="+", type=_bool, metavar="BOOL",
                    help="rollout.interrupt: true, false, or both to compare")
    ap.add_argument("--colocated", action=argparse.BooleanOptionalAction, default=None,
                    help="also simulate generation and training colocated on all the devices, taking turns, at each η "
                         "(the default; --no-colocated: the splits alone)")
    ap.add_argument("--lengths-file", metavar="FILE", help="answer lengths, a JSON list or one per line")
    ap.add_argument("--steps", type=_positive, default=20, help="train steps measured per candidate (after η + 2 of warm-up)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the length draws")
    ap.add_argument("--seeds", type=_positive, default=1, help="simulate each candidate with this many seeds (from "
                    "--seed on) and report the mean: steadier over few steps, that many times slower")
    ap.add_argument("--tie", type=float, default=0.01, help="throughputs within this fraction of the best tie; "
                    "the least stale of them is recommended")
    ap.add_argument("--plot", metavar="PNG", help="write throughput against η per split here")
    return ap


def inputs(args: argparse.Namespace) -> tuple[Costs, Candidates, list[str], tuple[int, int] | None]:
    """The costs and candidates from the cost file, the runs and the flags (flags win); the fit's notes."""
    if args.preset:
        found = presets()
        if args.preset not in found:
            raise AdviseError(f"--preset: no preset {args.preset!r}; there are {', '.join(found) or 'none'}")
        costs, cands = load_cost_file(found[args.preset])
    elif args.costs:
        costs, cands = load_cost_file(args.costs)
    elif args.from_run:
        costs, cands = parse_costs({})  # the defaults stand in for what the runs cannot give
    else:
        raise AdviseError("give the costs: --costs FILE, --preset NAME or --from-run RUN_DIR (docs/advise.md)")
    notes: list[str] = []
    run_split, run_colocated = None, False
    if args.from_run:
        fitted = fit_runs(args.from_run, costs)
        costs, notes, run_split, run_colocated = fitted.costs, fitted.notes, fitted.split, fitted.colocated
    work = costs.workload
    work = replace(work, batch_size=args.batch or work.batch_size, group_size=args.group_size or work.group_size,
                   max_concurrent=args.max_concurrent or work.max_concurrent)
    lengths = costs.lengths
    if args.lengths_file:
        lengths = Lengths(lengths.max_new_tokens, values=read_lengths_file(args.lengths_file, "--lengths-file"))
    if args.splits:
        cands = replace(cands, splits=tuple(parse_split(s) for s in args.splits))
    elif run_split and not args.devices:  # the run's own allocation, in devices
        cands = replace(cands, splits=(), devices=run_split[0]) if run_colocated else \
            replace(cands, splits=(run_split,), devices=None)
    cands = replace(cands, etas=tuple(args.etas) if args.etas else cands.etas, devices=args.devices or cands.devices,
                    colocated=cands.colocated if args.colocated is None else args.colocated)
    return replace(costs, workload=work, lengths=lengths), cands, notes, run_split


def candidates(cands: Candidates, interrupts: list[bool]) -> list[Candidate]:
    """Every split × η × interrupt setting, then colocated on all the devices of each device count
    × η (interrupting: colocation retracts the running answers at each train step). One device
    cannot be split: colocated is its only candidate."""
    out: list[Candidate] = []
    totals: list[int] = [cands.devices] if cands.devices else []
    if cands.devices == 1 and not cands.colocated:
        raise AdviseError("--devices 1: one device cannot be split between generation and training; colocated is "
                          "the only candidate there (drop --no-colocated, or colocated: false in the cost file)")
    for gen, train in cands.splits if cands.devices != 1 else ():
        if cands.devices:
            if cands.devices % (gen + train):
                raise AdviseError(f"--splits: {gen}:{train} does not divide --devices {cands.devices} "
                                  f"into whole devices ({gen + train} parts)")
            gen, train = cands.devices * gen // (gen + train), cands.devices * train // (gen + train)
        totals.append(gen + train)
        out += [Candidate(gen, train, eta, interrupt) for eta in cands.etas for interrupt in interrupts]
    if cands.colocated:
        out += [Candidate(total, total, eta, True, colocated=True) for total in dict.fromkeys(totals)
                for eta in cands.etas]
    if not out:
        raise AdviseError("no candidate: give --splits, or --devices N for colocated on N devices")
    return out


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(width=140)  # piped into a file: the table whole, not squeezed to 80 columns
    try:
        costs, cands, notes, _ = inputs(args)
        interrupts = args.interrupt or [costs.workload.interrupt]
        preds: list[Prediction] = []
        for cand in candidates(cands, interrupts):
            run_costs = replace(costs, workload=replace(costs.workload, interrupt=cand.interrupt))
            preds.append(simulate(run_costs, cand, steps=args.steps, seed=args.seed, seeds=args.seeds))
    except AdviseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for note in notes:
        console.print(f"[dim]fit:[/dim] {note}", highlight=False)
    console.print(costs_table(costs))
    best = recommend(preds, args.tie)
    console.print(predictions_table(preds, best))
    c = best.candidate
    where = (f"colocated on all {c.gen_devices} device(s) (generation and training taking turns), η = {c.eta}"
             if c.colocated else f"{c.gen_devices} generation and {c.train_devices} training devices, η = {c.eta}, "
             f"interrupt {'on' if c.interrupt else 'off'}")
    console.print(f"[bold]recommended:[/bold] {where}: {best.samples_per_s:.4g} trained samples/s, "
                  f"realised staleness {best.staleness_mean:.2f} on average (max {best.staleness_max})", highlight=False)
    if args.plot:
        plot(preds, args.plot, f"{costs.workload.batch_size}×{costs.workload.group_size}, {costs.lengths.describe()}")
        console.print(f"plot: {args.plot}", highlight=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
