"""Where a step's time goes: phase timers for the trainer, and the run's profile as a table and a timeline.

The trainer ranks time their phases (`Phases`) and report them with each step as
`train/<phase>_seconds`; the controller adds the step's wall time, the generation servers' weight
load (`update_seconds`) and their busy share (`generator_idle`). `profile_rows` turns a run's
metrics into mean seconds per step and shares of the step for each role, `profile_table` prints
them as Markdown, and `plot_timeline` draws the last steps as bars on a time axis.

The trainer's phases run one after the other inside the controller's `train_seconds` (the step's
dispatch to the last rank's reply), so the part no timer covers is shown as `other` (messages,
Python between phases). The generator's busy share is a fraction of each step, not intervals:
the timeline shows it as one bar per step whose shade is that share, with the weight load as the
exact interval it took after the trainer's step.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

# The trainer's phases in the order they run within a step.
TRAINER_PHASES = ("wait", "transport", "inputs", "prox", "packing", "forward", "backward", "forward_backward",
                  "optimizer", "publish", "flight")
PHASE_HELP = {
    "wait": "waiting for the step's groups to arrive on the inbox",
    "transport": "receiving and decoding groups, and moving groups between ranks",
    "inputs": "rewards to advantages and per-token loss inputs",
    "prox": "the π_prox forward pass (0 when a shortcut applies)",
    "packing": "packing sequences into rows and micro-batches",
    "forward": "model forward and logprobs, and the loss",
    "backward": "backward",
    "forward_backward": "megatron's pipeline schedule: forward and backward passes interleaved, and the grad reduce",
    "optimizer": "gradient clipping and the optimizer step",
    "publish": "writing the new weights for the servers (disk/shm modes)",
    "flight": "keeping the step's flight record (flight.record): its samples, generator states, weights digest",
    "other": "messages and Python between the timed phases",
    "idle": "waiting for work",
    "generate": "decoding or prefilling requests",
    "decode": "decode steps: one token for every running request",
    "prefill": "prefilling admitted requests' prompts (and, after an abort, their tokens so far)",
    "load weights": "loading the new version (the servers' count; SGLang: the controller's view of the update)",
    "wall": "the step, from the end of the previous step's training to the end of its own",
}


class Phases:
    """Seconds per named phase, summed over the `with phases("name"):` blocks since `reset()`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - t0

    def reset(self) -> dict[str, float]:
        """The phases so far, as `<phase>_seconds`, and a fresh start."""
        out = {f"{k}_seconds": v for k, v in self.seconds.items()}
        self.seconds = defaultdict(float)
        return out


def _steps(metrics: list[dict], skip_first: bool = True) -> list[dict]:
    steps = [m for m in metrics if m["event"] == "step"]
    return steps[1:] if skip_first and len(steps) > 1 else steps  # the first includes start-up


def profile_rows(metrics: list[dict]) -> list[tuple[str, str, float, float]]:
    """(role, phase, mean seconds per step, share of the step) over the run's steps but the first."""
    steps = _steps(metrics)
    if not steps:
        return []
    n = len(steps)
    step = sum(m["step_seconds"] for m in steps) / n
    rows = []
    timed = 0.0
    for phase in TRAINER_PHASES:
        values = [m.get(f"train/{phase}_seconds") for m in steps]
        if all(v is None for v in values):
            continue
        mean = sum(v or 0.0 for v in values) / n
        timed += mean
        rows.append(("trainer", phase, mean, mean / step))
    train = sum(m["train_seconds"] for m in steps) / n
    rows.append(("trainer", "other", max(0.0, train - timed), max(0.0, train - timed) / step))
    rows.append(("trainer", "idle", step - train, (step - train) / step))
    # The servers' own count of the time they spent loading; without it (SGLang), the controller's
    # view of each update, which also holds the drain of a non-interrupting update.
    loads = [m["generator_load"] for m in steps if m.get("generator_load") is not None]
    update = step * sum(loads) / len(loads) if loads else sum(m["update_seconds"] for m in steps) / n
    idle = [m["generator_idle"] for m in steps if m.get("generator_idle") is not None]
    if idle:
        busy = step * (1 - sum(idle) / len(idle))
        if all(m.get("gen/decode_seconds") is not None for m in steps):  # the engine's own split of its busy time
            prefill = sum(m["gen/prefill_seconds"] for m in steps) / n
            rows.append(("generator", "decode", busy - prefill, (busy - prefill) / step))
            rows.append(("generator", "prefill", prefill, prefill / step))
        else:
            rows.append(("generator", "generate", busy, busy / step))
    rows.append(("generator", "load weights", update, update / step))
    if idle:
        rest = max(0.0, step - busy - update)
        rows.append(("generator", "idle", rest, rest / step))
    rows.append(("step", "wall", step, 1.0))
    return rows


def profile_table(metrics: list[dict]) -> str:
    """The profile as a Markdown table, with what each phase covers."""
    rows = profile_rows(metrics)
    if not rows:
        return "no steps to profile\n"
    lines = [f"Mean over {len(_steps(metrics))} steps (the first, with start-up, left out).", "",
             "| role | phase | s/step | share of step | what |", "|---|---|---|---|---|"]
    for role, phase, sec, share in rows:
        lines.append(f"| {role} | {phase} | {sec:.4f} | {100 * share:.1f}% | {PHASE_HELP[phase]} |")
    return "\n".join(lines) + "\n"


def _window_end(m: dict) -> float:
    """Where a step row's window ends: where its training ends (trained_at); the servers load its
    weights from then on, while the trainer may already train the next step. (Rows without
    trained_at: where the row was written, after the load.)"""
    return m.get("trained_at", m["elapsed"])


def plot_timeline(metrics: list[dict], path: str, last: int = 8, title: str = "") -> str:
    """The last `last` steps on a time axis: the trainer's phases as consecutive segments within
    its step, the generator's busy share as the shade of each step and its weight load exactly."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = _steps(metrics)[-last:]
    # No green among them: green marks the generator's work.
    colours = dict(zip((*TRAINER_PHASES, "other"), ("tab:grey", "tab:orange", "tab:cyan", "tab:purple", "gold",
                                                    "tab:blue", "tab:red", "tab:pink", "tab:brown", "navy",
                                                    "olive", "lightgrey")))
    fig, ax = plt.subplots(figsize=(10, 2.8))
    t0 = _window_end(steps[0]) - steps[0]["step_seconds"] if steps else 0.0
    seen: set[str] = set()
    for m in steps:
        end = _window_end(m) - t0
        start = end - m["step_seconds"]
        trained_at = end if "trained_at" in m else end - m["update_seconds"]
        train_start = trained_at - m["train_seconds"]
        x = train_start
        timed = 0.0
        for phase in (*TRAINER_PHASES, "other"):
            sec = m.get(f"train/{phase}_seconds")
            if phase == "other":
                sec = max(0.0, m["train_seconds"] - timed)
            if not sec:
                continue
            timed += sec
            ax.barh(1, sec, left=x, color=colours[phase], label=None if phase in seen else phase)
            seen.add(phase)
            x += sec
        busy = 1 - (m.get("generator_idle") or 0.0)
        # A measured idle share can be slightly negative (or over 1): matplotlib refuses an alpha
        # outside [0, 1], which failed a finished run here. NaN falls to the floor too.
        ax.barh(0, end - start, left=start, color="tab:green", alpha=min(1.0, max(0.05, busy)),
                label=None if "gen" in seen else "generating (shade = busy share)")
        ax.barh(0, m["update_seconds"], left=trained_at, color="black",
                label=None if "load" in seen else "weight update (to every server loaded)")
        seen |= {"gen", "load"}
        ax.axvline(end, color="grey", lw=0.5)
    ax.set_yticks([0, 1], ["generator", "trainer"])
    ax.set_xlabel("seconds")
    ax.set_title(title or f"the last {len(steps)} steps")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
