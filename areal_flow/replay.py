"""`python -m areal_flow.replay RUN_DIR [--from-step A] [--to-step B] [--dump STEP]`: re-run the
trainer of a finished (or stopped) run alone, on its flight record, and check that every step ends
with the weights the run had, bit for bit (training/replay.py; docs/reliability.md, "Replay").

Steps are counted from 1, as the metrics rows and the record's file names count them. The replay
starts from the newest checkpoint saved before step A (or the run's base model) and replays every
recorded step up to B (default: the last), printing each step's verdict and, at the end, the first
step whose weights differ (if any), the largest difference of a weight (where the run saved its
weights after such a step) and of the step losses. A run of several trainer ranks replays as as
many processes, this one rank 0 (training/replay_ranks.py). `--dump STEP` also writes that step's
batch, the policy's logprobs before the update, the per-token ratios, behaviour weights, loss
inputs, loss terms and their gradients, and the weights after it, to RUN_DIR/replay/step-NNNNNNNN/.

`--regenerate STEP:UID` instead regenerates one recorded answer, span by span, from the weights of
the versions that made it (the run needs dump.weights=true and batch-invariant servers:
training/regenerate.py), and compares its tokens and logprobs with the record's.

Exit 0: every replayed step equal (the answer regenerated exactly); 1: a step differs (the answer
does); 2: the run cannot be replayed as asked.
"""

from __future__ import annotations

import argparse
import io
import logging
import sys

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from areal_flow.training.flight import RecordError
from areal_flow.training.replay import Replayer, ReplayError, StepResult
from areal_flow.training.replay_ranks import OtherRanks, check_ranks


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m areal_flow.replay", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run's directory (hydra.run.dir)")
    p.add_argument("--from-step", type=int, default=1, metavar="A", help="the first step to replay (from 1)")
    p.add_argument("--to-step", type=int, default=None, metavar="B", help="the last step to replay (default: the last recorded)")
    p.add_argument("--dump", type=int, action="append", default=[], metavar="STEP",
                   help="write this step's batch, logprobs, ratios and weights (repeatable)")
    p.add_argument("--regenerate", metavar="STEP:UID", default=None,
                   help="regenerate this recorded answer (its step from 1, its uid) and compare it with the record")
    # A run of several trainer ranks: the process the user started is rank 0 and starts the others
    # with these (training/replay_ranks.py).
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def replay(args: argparse.Namespace, console: Console, port: int | None, rank: int = 0) -> list[StepResult]:
    replayer = Replayer(args.run_dir, rank, port)
    last = replayer.steps[-1] + 1 if args.to_step is None else args.to_step
    if args.from_step < 1 or last < args.from_step:
        raise ReplayError(f"--from-step {args.from_step} --to-step {last}: steps are counted from 1, the first "
                          "not after the last")
    checkpoint = replayer.start(args.from_step - 1)
    first = replayer.trained.version  # where the checkpoint (or the base model) stands
    missing = sorted(set(range(first, last)) - set(replayer.steps))
    if missing:
        raise ReplayError(f"{args.run_dir}: the flight record has no step {missing[0] + 1} of rank {rank} (it has "
                          f"{replayer.steps[0] + 1}-{replayer.steps[-1] + 1}, {len(replayer.steps)} steps)")
    check_ranks(args.run_dir, range(first, last), replayer.spec.n_trainers)
    console.print(f"replaying steps {first + 1}-{last} of {args.run_dir} from "
                  f"{checkpoint or 'the base model'}" + _catching_up(first + 1, args.from_step))
    results = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("replay", total=last - first)
        for step in range(first, last):
            results.append(replayer.step(step, dump=step + 1 in args.dump))
            progress.advance(task)
    return results


def _catching_up(first: int, wanted: int) -> str:
    """What the replay runs before the first step asked for (steps from 1)."""
    if first >= wanted:
        return ""
    steps = f"step {first}" if first == wanted - 1 else f"steps {first}-{wanted - 1}"
    return f" ({steps} to get to {wanted})"


def report(results: list[StepResult], console: Console) -> int:
    table = Table(title="replayed steps")
    for column in ("step", "weights", "max |Δ weight|", "loss (run)", "loss (replay)"):
        table.add_column(column)
    for r in results:
        ranks = f"rank{'s' * (len(r.differ) > 1)} {', '.join(map(str, r.differ))}"
        verdict = "equal" if r.equal else f"[red]differ[/red] on {ranks}"
        table.add_row(str(r.step + 1), verdict, "-" if r.weight_gap is None else f"{r.weight_gap:.3g}",
                      _fmt(r.recorded_loss), _fmt(r.loss))
    console.print(table)
    losses = [abs(r.loss - r.recorded_loss) for r in results if r.loss is not None and r.recorded_loss is not None]
    largest = max(losses, default=0.0)
    differ = [r for r in results if not r.equal]
    if not differ:
        console.print(f"[green]all {len(results)} steps equal[/green]: every step's weights bit for bit the run's "
                      f"(max |Δ weight| 0; largest |Δ loss| {largest:.3g})")
        return 0
    measured = [r.weight_gap for r in differ if r.weight_gap is not None]
    gap = (f"largest |Δ weight| {max(measured):.3g} where the run saved its weights"
           if measured else "no weights saved at those steps to measure by how much (a checkpoint or dump.weights)")
    console.print(f"[red]{len(differ)} of {len(results)} steps differ[/red]: the first is step {differ[0].step + 1}; "
                  f"{gap}; largest |Δ loss| {largest:.3g}")
    return 1


def regenerate_one(args: argparse.Namespace, console: Console) -> int:
    from areal_flow.training.regenerate import regenerate  # (loads the generation engine)

    step, sep, uid = args.regenerate.partition(":")
    if not sep or not step.isdigit() or int(step) < 1 or not uid:
        raise ReplayError(f"--regenerate {args.regenerate!r}: expected STEP:UID, the step from 1")
    got = regenerate(args.run_dir, int(step) - 1, uid)
    spans = ", ".join(f"{n} tokens of version {v}" for v, n in got.spans)
    console.print(f"regenerated {uid} of step {step} from {spans}")
    if got.logprobs_equal:
        console.print(f"[green]equal[/green]: the same {len(got.tokens)} tokens and behaviour logprobs, bit for bit")
        return 0
    first = next((i for i, (a, b) in enumerate(zip(got.tokens, got.recorded_tokens)) if a != b),
                 min(len(got.tokens), len(got.recorded_tokens)))
    if got.tokens_equal:
        gap = float(np.max(np.abs(np.float32(got.logprobs) - np.float32(got.recorded_logprobs))))
        console.print(f"[red]logprobs differ[/red]: the same tokens, largest |Δ logprob| {gap:.3g}")
    else:
        console.print(f"[red]tokens differ[/red] from token {first} on ({len(got.tokens)} regenerated, "
                      f"{len(got.recorded_tokens)} recorded)")
    return 1


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.6g}"


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.rank is not None:  # one of a run's ranks, started by rank 0's replay
        return replay_rank(args)
    console = Console()
    try:
        if args.regenerate is not None:
            return regenerate_one(args, console)
        with OtherRanks(args.run_dir, _rank_argv(args), console) as port:
            results = replay(args, console, port)
    except (ReplayError, RecordError, FileNotFoundError) as e:
        console.print(f"[red]cannot replay[/red]: {e}")
        return 2
    return report(results, console)


def replay_rank(args: argparse.Namespace) -> int:
    """Rank `args.rank` of a run of several: replay silently beside rank 0, which reports."""
    try:
        replay(args, Console(file=io.StringIO()), args.port, args.rank)
    except (ReplayError, RecordError, FileNotFoundError) as e:
        print(e, file=sys.stderr)
        return 2
    return 0


def _rank_argv(args: argparse.Namespace) -> list[str]:
    """The arguments every rank replays with (the steps and dumps)."""
    argv = [args.run_dir, "--from-step", str(args.from_step)]
    if args.to_step is not None:
        argv += ["--to-step", str(args.to_step)]
    for step in args.dump:
        argv += ["--dump", str(step)]
    return argv


if __name__ == "__main__":
    sys.exit(main())
