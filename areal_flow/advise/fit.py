"""Costs fitted from what runs already record: `metrics.jsonl` (one row per train step, written by
controller/step_metrics.py and run_metrics.py) and the resolved `config.yaml` of each run directory.

What a step row gives and what is fitted from it:

| fitted | from |
|---|---|
| c, d (train step = c + d·tokens) | the trainer's phase timers: d from packing, forward and backward over `train/n_tokens`, c the rest of `train_seconds` − `train/prox_seconds`; without timers, least squares of that against `train/n_tokens` |
| prox_fraction | `train/prox_seconds` over d·tokens on the steps that ran the prox forward |
| w (update pause) | `generator_load` (the servers' own load time) with interrupt=false, else the least `update_seconds` there (the rest is the drain); the interrupting pause: the median `update_seconds` with interrupt=true |
| a, b, e, p0, p (decode step = a + b·n + e·k, prefill = p0 + p·positions) | the servers' compute counts (`gen/*`, generation/compute_counts.py): least squares of each decode step's seconds against its answers n and the KV positions k they read (padding included), and of each prefill's seconds against the positions it computes (padding included; p0 = a where the prefills are all of one size). Without counts (SGLang), the rows below |
| answer_s | the servers' time neither computing, loading nor waiting for work (`gen/waited`) over the answers they handed back (`gen/answered`) |
| a, b (decode step = a + b·n) | busy seconds per server (1 − `generator_idle`)·`step_seconds` over tokens per server (`gen_tokens_per_second`·`step_seconds`) = b + a/n, with n the running answers per server (`running`·G) |
| p (prefill per token) | busy time of interrupting runs beyond a, b, over the tokens they re-prefill (needs runs of both kinds) |
| lengths | lognormal from the mean `response_length` and the mean `response_length_max` (or, when over 1% of the answers are truncated, `truncated_fraction`) |
| prompt tokens | (`train/n_tokens` − answer tokens) / answers |
| filtered_fraction | `filtered_groups` over those and the groups trained |
| lengths, with filtering | mean: the generated tokens (`gen_tokens_per_second`·`step_seconds`) over the answers of the groups trained and filtered |
| latency (admission to request, last answer to controller) | `ledger.jsonl`: the mean over groups of `requested` − the `admit` event's time, and of the `finish`/`filter` event's time − `generated` |
| join_group | the embedded engine joins a long queue into a running batch max_batch_size // 8 at a time (config.yaml); 1 for SGLang |
| colocated | the generate node's mesh equals the train node's (config.yaml): such a run counts as synchronous for sharing (the two take turns), and its train_seconds hold the release and resume, so colocated_switch_s = 0 |
| lengths, from `ledger.jsonl` | every finished and filtered group's answer lengths (`lengths` of its `finish` or `filter` event): the simulation draws recorded groups whole, a filtered one from the filtered (first before the two rows above) |

Without the engine's compute counts (SGLang's servers), n is the running count the controller logs
at the end of each step: the servers' load reports (/v1/loads) are not in metrics.jsonl. What
cannot be fitted is taken from the cost file, and each such value is named in the notes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from statistics import median
from typing import Any

import numpy as np
import yaml

from areal_flow.advise.costs import AdviseError, Costs, Latency, Lengths, lognormal_from_max, lognormal_from_truncation
from areal_flow.generation.compute_counts import COMPUTE_COUNTS
from areal_flow.graph.mesh import parse_mesh
from areal_flow.metrics.writer import read_metrics

TOKEN_PHASES = ("packing", "forward", "backward", "forward_backward")
"""The trainer's phases (metrics/profile.py) whose time scales with the tokens of a step."""

EMBEDDED_MAX_BATCH = 128
"""The embedded engine's max_batch_size when generation.max_batch_size is null (generation/engine/options.py)."""


@dataclass(frozen=True)
class RunFacts:
    """One run directory: its settings and its step rows (the first, which includes start-up, left out)."""

    path: str
    steps: list[dict]
    batch_size: int
    group_size: int
    max_new_tokens: int
    eta: int
    interrupt: bool
    max_concurrent: int | None
    gen_devices: int
    servers: int
    train_devices: int
    max_running: int | None
    join_group: int  # queued answers join a running batch only this many at once (the embedded engine's rule)
    ppo_epochs: int
    trainer_waits: bool  # weights by broadcast: the trainer sends them, so it waits for each update
    colocated: bool = False  # generation and training on the same devices, taking turns (docs/colocation.md)
    groups: tuple[tuple[int, ...], ...] = ()  # answer lengths of each group finished for training (ledger.jsonl)
    filtered_groups: tuple[tuple[int, ...], ...] = ()  # those of each group dynamic filtering dropped
    admit_s: tuple[float, ...] = ()  # per scored group: seconds from its admission to its request
    deliver_s: tuple[float, ...] = ()  # per scored group: seconds from its last answer to the controller

    @property
    def overlaps(self) -> bool:
        """Generation and training run at the same time (η > 0 on devices of their own); at η = 0,
        or colocated, they take turns."""
        return self.eta > 0 and not self.colocated


@dataclass(frozen=True)
class Fitted:
    """The costs to simulate with, what each came from, and the run's own allocation."""

    costs: Costs
    notes: list[str]
    split: tuple[int, int]
    eta: int
    colocated: bool = False
    """the run's generation and training shared their devices (split: all of them, twice)."""


def _get(cfg: dict, dotted: str, default: Any = None) -> Any:
    node: Any = cfg
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return default
        node = node[key]
    return node


def read_run(path: str | Path) -> RunFacts:
    """The settings (config.yaml, else the metrics' start row) and step rows of one run directory."""
    path = Path(path)
    metrics_file = path / "metrics.jsonl"
    if not metrics_file.is_file():
        raise AdviseError(f"--from-run: {str(path)!r} has no metrics.jsonl")
    try:
        rows = read_metrics(str(metrics_file))
    except ValueError as exc:
        raise AdviseError(f"--from-run: {str(metrics_file)!r} is not JSON lines: {exc}") from None
    start = next((r for r in rows if r.get("event") == "start"), {})
    steps = [r for r in rows if r.get("event") == "step"][1:]
    if len(steps) < 2:
        raise AdviseError(f"--from-run: {str(metrics_file)!r} has {len(steps) + 1 if steps else 0} step rows; "
                          "at least 3 are needed (the first includes start-up)")
    cfg: dict = {}
    if (path / "config.yaml").is_file():
        cfg = yaml.safe_load((path / "config.yaml").read_text()) or {}
    nodes = _get(cfg, "graph", {}) or {}
    judges = [name for name, n in nodes.items() if isinstance(n, dict) and n.get("role") == "judge"]
    if judges:  # its group's deliver time would hold the judge's answers, which the model does not cost
        raise AdviseError(f"advise: node '{judges[0]}' is a judge, whose time the model does not have "
                          f"(--from-run {str(path)!r})")
    gen_mesh = next((n.get("mesh") for n in nodes.values() if isinstance(n, dict) and n.get("type") == "generate"
                     and n.get("role") != "judge"), None)
    train_mesh = next((n.get("mesh") for n in nodes.values() if isinstance(n, dict) and n.get("type") == "train"), None)
    gen_placed = parse_mesh(gen_mesh, "generate")[0] if gen_mesh is not None else None
    train_placed = parse_mesh(train_mesh, "train")[0] if train_mesh is not None else None
    gen_devices = len(gen_placed or (0,)) if gen_mesh is not None else 1
    train_devices = len(train_placed or (0,)) if train_mesh is not None else 1
    tp = int(_get(cfg, "generation.tp_size", 1) or 1)
    backend = _get(cfg, "generation.backend", "embedded")
    max_batch = _get(cfg, "generation.max_batch_size")
    return RunFacts(
        path=str(path), steps=steps,
        batch_size=int(_get(cfg, "algorithm.batch_size", start.get("batch_size", 0)) or 0),
        group_size=int(_get(cfg, "algorithm.group_size", start.get("group_size", 0)) or 0),
        max_new_tokens=int(_get(cfg, "algorithm.max_new_tokens", 0) or 0),
        eta=int(_get(cfg, "rollout.max_staleness", start.get("max_staleness", 0)) or 0),
        interrupt=bool(_get(cfg, "rollout.interrupt", True)),
        max_concurrent=_get(cfg, "rollout.max_concurrent"),
        gen_devices=gen_devices, servers=max(1, gen_devices // tp), train_devices=train_devices,
        max_running=max_batch if max_batch is not None else (EMBEDDED_MAX_BATCH if backend == "embedded" else None),
        join_group=max(1, (max_batch or EMBEDDED_MAX_BATCH) // 8) if backend == "embedded" else 1,
        ppo_epochs=int(_get(cfg, "algorithm.ppo_epochs", 1) or 1),
        trainer_waits=_get(cfg, "rollout.weight_update_mode", "disk") in ("distributed", "ipc"),  # the trainer sends
        colocated=bool(gen_placed) and gen_placed == train_placed,  # Graph.colocated's rule
        **_read_ledger(path / "ledger.jsonl"),
    )


def _read_ledger(ledger: Path) -> dict[str, Any]:
    """From a run's ledger (runs since it records them; nothing from older runs): each finished and
    each filtered group's answer lengths, and per group the control path's two delays: admission to
    its request (`requested` − its `admit`), and its last answer to the controller (the event's
    time − `generated`)."""
    groups: dict[str, list[tuple[int, ...]]] = {"finish": [], "filter": []}
    admitted: dict[int, float] = {}
    admit_s, deliver_s = [], []
    if ledger.is_file():
        with open(ledger, "rb") as f:
            for line in f:
                if b'"lengths"' not in line and b'"admit"' not in line:  # steps and updates: skipped unparsed
                    continue
                try:
                    event = json.loads(line)
                except ValueError:
                    raise AdviseError(f"--from-run: {str(ledger)!r} has a line that is not JSON: {line[:80]!r}") from None
                kind = event.get("event")
                if kind == "admit":
                    admitted[event["group"]] = event["time"]
                elif kind in groups:
                    groups[kind].append(tuple(int(n) for n in event["lengths"]))
                    if "requested" in event and event.get("group") in admitted:
                        admit_s.append(event["requested"] - admitted[event["group"]])
                        deliver_s.append(event["time"] - event["generated"])
    return {"groups": tuple(groups["finish"]), "filtered_groups": tuple(groups["filter"]),
            "admit_s": tuple(admit_s), "deliver_s": tuple(deliver_s)}


def _line(xs: list[float], ys: list[float], ws: list[float] | None = None) -> tuple[float, float] | None:
    """Weighted least squares y = intercept + slope·x; None when x does not vary (≤ 5% of its mean)."""
    ws = ws or [1.0] * len(xs)
    sw = sum(ws)
    mx, my = sum(w * x for w, x in zip(ws, xs)) / sw, sum(w * y for w, y in zip(ws, ys)) / sw
    var = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs)) / sw
    if len(xs) < 2 or math.sqrt(var) <= 0.05 * abs(mx):
        return None
    slope = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys)) / (sw * var)
    return my - slope * mx, slope


def _train(runs: list[RunFacts], base: Costs, notes: list[str]) -> Any:
    rows = [(r, s) for r in runs for s in r.steps if s.get("train/n_tokens") and s.get("train_seconds") is not None]
    if not rows:
        notes.append(f"training: no step has train_seconds and train/n_tokens; c, d from the cost file "
                     f"({base.train.step_fixed_s:g} s, {base.train.per_token_s:g} s/token)")
        return base.train
    # d is per device: a run on k data-parallel devices trains k times faster (at the cost file's efficiency).
    scale = [r.train_devices * base.train.dp_efficiency for r, _ in rows]
    tokens = [s["train/n_tokens"] / r.ppo_epochs for r, s in rows]
    plain = [s["train_seconds"] - (s.get("train/prox_seconds") or 0.0) for _, s in rows]
    per_device = [t / k for t, k in zip(tokens, scale)]
    timed = [sum(s.get(f"train/{p}_seconds") or 0.0 for p in TOKEN_PHASES) for _, s in rows]
    if all(timed):
        # The trainer's own phase timers split the step: the passes over the tokens scale with them,
        # the rest (optimizer, inputs, publish, messages) is per step. Fitting c and d from totals
        # needs tokens per step that vary, which a fixed batch shape hardly gives.
        d = sum(timed) / sum(per_device)
        c = max(0.0, sum(p - t for p, t in zip(plain, timed)) / len(rows))
        notes.append(f"training: c = {c:.3g} s, d = {d:.3g} s/token/device, from the trainer's phase timers on "
                     f"{len(rows)} steps ({' + '.join(TOKEN_PHASES)} scale with tokens)")
    elif (fit := _line(per_device, plain)) is not None and fit[0] >= 0 and fit[1] > 0:
        c, d = fit
        notes.append(f"training: c = {c:.3g} s, d = {d:.3g} s/token/device, fitted on {len(rows)} steps")
    else:
        c = min(base.train.step_fixed_s, 0.5 * sum(plain) / len(plain))
        d = (sum(plain) - c * len(plain)) / sum(per_device)
        notes.append(f"training: tokens per step vary too little to separate c from d; c = {c:.3g} s from the cost "
                     f"file (at most half a step), d = {d:.3g} s/token/device from the mean step")
    prox = [(s["train/prox_seconds"], d * t / k) for (_, s), t, k in zip(rows, tokens, scale) if s.get("train/prox_seconds")]
    if prox:
        fraction = sum(p for p, _ in prox) / sum(q for _, q in prox)
        notes.append(f"training: prox_fraction = {fraction:.3g}, from the {len(prox)} steps that ran the prox forward")
    else:
        fraction = base.train.prox_fraction
        notes.append(f"training: no step ran the prox forward; prox_fraction = {fraction:g} from the cost file")
    return replace(base.train, step_fixed_s=c, per_token_s=d, prox_fraction=fraction)


def _update(runs: list[RunFacts], base: Costs, notes: list[str]) -> Any:
    """w from the servers' own load time in runs that wait (else their least update: the load with
    the shortest drain) and the interrupting pause from the runs that interrupt (the median); an
    update of either kind costs differently (an abort answers every running request)."""
    interrupting = [s["update_seconds"] for r in runs if r.interrupt for s in r.steps if s.get("update_seconds") is not None]
    waiting = [s["update_seconds"] for r in runs if not r.interrupt for s in r.steps if s.get("update_seconds") is not None]
    w, w_interrupt = base.update.pause_s, base.update.interrupt_pause_s
    # The servers' own count of their load time (areal_flow's engine); SGLang's does not report it.
    loads = [s["generator_load"] * s["step_seconds"] for r in runs if not r.interrupt for s in r.steps
             if s.get("generator_load") is not None]
    if loads:
        w = sum(loads) / len(loads)
        notes.append(f"weights: pause w = {w:.3g} s, the servers' mean load time per step (generator_load) "
                     f"over {len(loads)} steps")
    elif waiting:
        w = min(waiting)
        notes.append(f"weights: pause w = {w:.3g} s, the least update_seconds of {len(waiting)} steps (without "
                     "interruption an update also waits for the running answers)")
    if interrupting:
        w_interrupt = median(interrupting)
        notes.append(f"weights: interrupting pause = {w_interrupt:.3g} s, the median update_seconds of "
                     f"{len(interrupting)} interrupting steps")
        if not waiting and not loads:
            w = w_interrupt
            notes.append("weights: no run waits for its answers; w = the interrupting pause")
    if not waiting and not interrupting:
        notes.append(f"weights: no update_seconds; w = {w:g} s from the cost file")
    switch = base.update.colocated_switch_s
    if any(r.colocated for r in runs):
        # The controller times a colocated step's train_seconds from the servers' release to their resume.
        switch = 0.0
        notes.append("weights: colocated_switch_s = 0: a colocated run's train_seconds include the servers freeing "
                     "their memory and taking it back, so c holds that")
    return replace(base.update, pause_s=w, interrupt_pause_s=w_interrupt, trainer_waits=runs[0].trainer_waits,
                   colocated_switch_s=switch)


def _counted_generation(runs: list[RunFacts], base: Costs, notes: list[str]) -> Any | None:
    """a, b, e, p0 and p from the servers' own compute counts (`gen/*` in the step rows, the
    embedded engine's): a decode step costs a + b·n + e·k (k the KV positions its n answers read,
    padding included) by least squares over every decode step of every run (decode and prefill are
    timed apart, so interrupting runs count too), and a prefill p0 + p per position computed, by
    least squares over the prefills. None when the runs have no counts (SGLang)."""
    rows = [s for r in runs for s in r.steps if s.get("gen/decode_steps")]
    if not rows:
        return None
    total = {key: sum(s.get(f"gen/{key}", 0.0) for s in rows) for key in COMPUTE_COUNTS}
    steps, n, k = total["decode_steps"], total["decode_rows"], total["decode_kv"]
    a, b, e = _decode_least_squares(total)
    if e > 0:
        notes.append(f"generation: a = {a:.3g} s, b = {b:.3g} s/answer, e = {e:.3g} s/KV position per decode step, "
                     f"least squares over the servers' {steps:.0f} decode steps (their compute counts; "
                     f"{n / steps:.1f} answers reading {k / steps:.0f} positions on average)")
    elif b > 0:
        notes.append(f"generation: a = {a:.3g} s, b = {b:.3g} s/answer per decode step, least squares over the "
                     f"servers' {steps:.0f} decode steps (their compute counts; n from {n / steps:.1f} on average; "
                     "the KV positions read too close to n·const to separate: e = 0, b holds them)")
    else:
        notes.append(f"generation: decode steps of {n / steps:.1f} answers on average vary too little in size to "
                     f"separate a from b; a = {a:.3g} s, the mean step, b = 0")
    gen = base.gen
    # The padding a prefill computes, where counted (the embedded engine pads to the longest sequence).
    padded = bool(total["prefill_positions"] or total["decode_kv"])
    if total["prefills"]:
        p0, p, how = _prefill_least_squares([(s, 1.0) for s in rows], a)
        unit = "position" if padded else "token"
        notes.append(f"generation: p0 = {p0:.3g} s, p = {p:.3g} s/{unit} per prefill, {how} over "
                     f"{total['prefills']:.0f} prefills of {_prefill_size(total) / total['prefills']:.0f} {unit}s on average")
        gen = replace(gen, prefill_fixed_s=p0, prefill_per_token_s=p)
    return replace(gen, step_fixed_s=a, step_per_seq_s=b, step_per_context_token_s=e, padded=padded,
                   answer_s=_answer_seconds(rows, gen.answer_s, notes))


def _answer_seconds(rows: list[dict], default: float, notes: list[str]) -> float:
    """The server's time per answer outside compute: each step row's window less the counted
    decode, prefill, load and wait for work, over the answers it handed back (counts since the
    engine records `waited` and `answered`)."""
    rows = [s for s in rows if s.get("gen/answered") and s.get("gen/waited") is not None]
    answered = sum(s["gen/answered"] for s in rows)
    if not answered:
        notes.append(f"generation: answer_s = {default:g} s from the cost file (no counts of the servers' waits)")
        return default
    rest = sum(s["step_seconds"] * (1 - (s.get("generator_load") or 0.0)) - s["gen/decode_seconds"]
               - s["gen/prefill_seconds"] - s["gen/waited"] for s in rows)
    answer_s = max(0.0, rest / answered)
    notes.append(f"generation: answer_s = {answer_s:.3g} s: the servers' {rest:.1f} s neither computing, loading nor "
                 f"waiting for work, over the {answered:.0f} answers they handed back")
    return answer_s


def _prefill_size(total: dict) -> float:
    """Σ m over the prefills: the positions computed (padding included) where counted, else the tokens."""
    return total.get("prefill_positions") or total.get("prefill_tokens", 0.0)


def _prefill_least_squares(rows: list[tuple[dict, float]], a: float) -> tuple[float, float, str]:
    """(p0, p, how) minimising Σ (t − p0 − p·m)² over the counted prefills of the step rows, each
    row's seconds divided by its factor (what they cost alone). Without Σ m² (older counts) or with
    prefills all of about one size, p0 = a (a forward's fixed cost) and p the rest per position."""
    total = {key: sum(s.get(f"gen/{key}", 0.0) / (f if "seconds" in key else 1.0) for s, f in rows)
             for key in COMPUTE_COUNTS}
    count, m, t = total["prefills"], _prefill_size(total), total["prefill_seconds"]
    m2, mt = total["prefill_positions_sq"], total["prefill_position_seconds"]
    spread = count * m2 - m * m  # count² · variance of m
    if m2 and spread > (0.05 * m) ** 2:
        p = (count * mt - m * t) / spread
        if p >= 0 and (p0 := (t - p * m) / count) >= 0:
            return p0, p, "least squares"
    return a, max(0.0, (t - a * count) / m) if m else 0.0, "p0 = a (sizes too alike to separate), p the rest"


def _decode_least_squares(total: dict[str, float]) -> tuple[float, float, float]:
    """(a, b, e) minimising Σ (t − a − b·n − e·k)² over the counted decode steps; e = 0 where k
    hardly varies apart from n (or no k was counted), b = 0 too where n hardly varies, and a term
    whose coefficient comes out negative is dropped (that much noise, not a cost)."""
    steps, n, n2, t, nt = (total[key] for key in ("decode_steps", "decode_rows", "decode_rows_sq",
                                                  "decode_seconds", "decode_row_seconds"))
    k, k2, nk, kt = (total[key] for key in ("decode_kv", "decode_kv_sq", "decode_rows_kv", "decode_kv_seconds"))
    spread_n = steps * n2 - n * n  # steps² · variance of n
    if k and spread_n > (0.05 * n) ** 2:
        gram = np.array([[steps, n, k], [n, n2, nk], [k, nk, k2]], dtype=float)
        # What of k's variance n does not explain (the Schur complement), against k's mean: a 5% spread.
        left = k2 - np.array([k, nk]) @ np.linalg.solve(gram[:2, :2], np.array([k, nk]))
        if left > steps * (0.05 * k / steps) ** 2:
            scale = np.array([1.0, steps / n, steps / k])  # columns of one size: a well-conditioned solve
            a, b, e = scale * np.linalg.solve(gram * np.outer(scale, scale), scale * np.array([t, nt, kt]))
            if min(a, b, e) >= 0:
                return float(a), float(b), float(e)
    b = (steps * nt - n * t) / spread_n if spread_n > (0.05 * n) ** 2 else -1.0
    if b >= 0 and (a := (t - b * n) / steps) >= 0:
        return a, b, 0.0
    return t / steps, 0.0, 0.0


def _overlap(row: dict) -> float:
    """The share of a step row's time the trainer trained."""
    if not row.get("step_seconds") or row.get("train_seconds") is None:
        return 1.0
    return min(1.0, row["train_seconds"] / row["step_seconds"])


def _decode_alone_seconds(gen: Any, row: dict) -> float:
    """What a step row's counted decode steps cost at `gen`'s a, b, e."""
    return (gen.step_fixed_s * row["gen/decode_steps"] + gen.step_per_seq_s * row["gen/decode_rows"]
            + gen.step_per_context_token_s * row.get("gen/decode_kv", 0.0))


def _generation(runs: list[RunFacts], base: Costs, prompt: float, mean_len: float, notes: list[str]) -> Any:
    """From the servers' compute counts where the runs have them; else a and b from runs that do
    not interrupt (an interrupting run's busy time includes re-prefills), then p from the
    interrupting runs' busy time beyond them."""
    first = runs[0]
    placement = {"max_running": first.max_running, "join_group": first.join_group,
                 "devices_per_server": max(1, first.gen_devices // first.servers)}
    if (counted := _counted_generation(runs, base, notes)) is not None:
        return replace(counted, **placement)
    def points(rs: list[RunFacts]) -> list[tuple[float, float, float, RunFacts, dict]]:
        out = []
        for r in rs:
            for s in r.steps:
                if s.get("generator_idle") is None or not s.get("gen_tokens_per_second") or not s.get("running"):
                    continue
                busy = (1 - s["generator_idle"]) * s["step_seconds"]
                tokens = s["gen_tokens_per_second"] * s["step_seconds"] / r.servers
                n = min(s["running"] * r.group_size / r.servers, r.max_running or math.inf)
                out.append((busy, tokens, max(1.0, n), r, s))
        return out

    plain = points([r for r in runs if not r.interrupt]) or points(runs)
    gen = base.gen
    if not plain:
        notes.append("generation: no step has generator_idle, gen_tokens_per_second and running; a, b, p from the cost file")
        return gen
    busy, tokens = sum(p[0] for p in plain), sum(p[1] for p in plain)
    per_seq_steps = sum(p[1] / p[2] for p in plain)  # Σ tokens / n = decode steps
    fit = _line([1 / p[2] for p in plain], [p[0] / p[1] for p in plain], [p[1] for p in plain])
    if fit is not None and fit[0] >= 0 and fit[1] >= 0:
        b, a = fit
        notes.append(f"generation: a = {a:.3g} s, b = {b:.3g} s/answer per decode step, fitted on {len(plain)} steps "
                     "(prompt prefill included)")
    else:
        a = gen.step_fixed_s
        b = (busy - a * per_seq_steps) / tokens
        if b < 0:
            a, b = busy / per_seq_steps, 0.0
        notes.append(f"generation: running answers per server vary too little to separate a from b; a = {a:.3g} s "
                     f"{'from the cost file' if b > 0 else 'from the mean step'}, b = {b:.3g} s from the mean step")
    if any(not r.interrupt for r in runs) and any(r.interrupt for r in runs):
        hit = points([r for r in runs if r.interrupt])
        excess = sum(p[0] - a * p[1] / p[2] - b * p[1] for p in hit)
        # Each update re-prefills every running answer: prompt + about half its length so far.
        refill = sum(p[2] * (prompt + mean_len / 2) for p in hit)
        p_token = max(0.0, excess / refill) if refill else 0.0
        notes.append(f"generation: p = {p_token:.3g} s/token, the interrupting runs' busy time beyond a, b over the "
                     "tokens they re-prefill")
    else:
        p_token = gen.prefill_per_token_s
        notes.append(f"generation: p = {p_token:g} s/token from the cost file (fitting it needs runs with and without "
                     "rollout.interrupt; a fresh prompt's prefill is already inside a, b)")
    if gen.step_per_context_token_s:
        notes.append("generation: e (step_per_context_token_s) set to 0: the fitted b holds the KV cache read")
    return replace(gen, step_fixed_s=a, step_per_seq_s=b, step_per_context_token_s=0.0, prefill_per_token_s=p_token,
                   **placement)


def _lengths(rows: list[dict], mean_len: float, top: int, answers: int, base: Costs, notes: list[str]) -> Lengths:
    """The answer-length distribution: a lognormal with the runs' mean length and, while almost no
    answer is truncated, the mean longest answer of a step (response_length_max); else the
    truncated share pins its tail."""
    truncated = sum(s.get("truncated_fraction", 0.0) for s in rows) / len(rows)
    longest = [s["response_length_max"] for s in rows if s.get("response_length_max") is not None]
    if longest and truncated < 0.01:
        mean_max = sum(longest) / len(longest)
        if (lengths := lognormal_from_max(mean_len, mean_max, answers, top)) is not None:
            notes.append(f"lengths: lognormal with mean {mean_len:.0f} and sigma {lengths.sigma:.2f}, whose longest "
                         f"of {answers} answers is {mean_max:.0f} on average, as response_length_max says "
                         f"(almost no answer reaches max {top})")
            return lengths
    if mean_len > 0 and (lengths := lognormal_from_truncation(mean_len, truncated, top)) is not None:
        notes.append(f"lengths: lognormal with mean {mean_len:.0f} and {truncated:.1%} at max {top} (sigma "
                     f"{lengths.sigma:.2f}), from response_length and truncated_fraction")
        return lengths
    if mean_len > 0:
        sigma = base.lengths.sigma if not base.lengths.values else 0.5
        notes.append(f"lengths: mean {mean_len:.0f} from response_length; no answer was truncated, so the tail is "
                     f"not in the metrics: sigma {sigma:g} from the cost file (give --lengths-file for the real one)")
        return Lengths(top, mean=min(mean_len, top), sigma=sigma)
    notes.append("lengths: no response_length in the metrics; taken from the cost file")
    return base.lengths


def _generated_mean(runs: list[RunFacts], notes: list[str]) -> float | None:
    """The mean length of every generated answer where dynamic filtering dropped groups (the
    generator's tokens over the answers of the groups trained and filtered), else None: the
    filtered groups' answers differ in length from the trained ones (on tiny_arith the all-wrong
    groups' answers run long), and the servers generate both."""
    rows = [(r, s) for r in runs for s in r.steps if s.get("gen_tokens_per_second") is not None]
    filtered = sum(s.get("filtered_groups", 0) for _, s in rows)
    if not filtered:
        return None
    tokens = sum(s["gen_tokens_per_second"] * s["step_seconds"] for _, s in rows)
    answers = sum((r.batch_size + s.get("filtered_groups", 0)) * r.group_size for r, s in rows)
    mean = tokens / answers
    notes.append(f"lengths: every generated answer, filtered groups' included, is {mean:.1f} tokens on average "
                 "(gen_tokens_per_second over the groups trained and filtered); response_length counts only "
                 "the trained ones")
    return mean


def _filtered(runs: list[RunFacts], notes: list[str]) -> float:
    """The share of finished groups dynamic filtering dropped: `filtered_groups` over those and the
    groups trained (batch_size a step), over every step row."""
    filtered = sum(s.get("filtered_groups", 0) for r in runs for s in r.steps)
    if not filtered:
        return 0.0
    trained = sum(r.batch_size * len(r.steps) for r in runs)
    fraction = filtered / (filtered + trained)
    notes.append(f"workload: filtered_fraction = {fraction:.3g}: dynamic filtering dropped {filtered} groups "
                 f"beside {trained} trained")
    return fraction


def _latency(runs: list[RunFacts], base: Costs, notes: list[str]) -> Latency:
    """The control path's mean delays over every group the ledgers time; else the cost file's."""
    admit = [x for r in runs for x in r.admit_s]
    if not admit:
        notes.append("latency: no ledger with the groups' stage times; taken from the cost file")
        return base.latency
    deliver = [x for r in runs for x in r.deliver_s]
    latency = Latency(admit_s=sum(admit) / len(admit), deliver_s=sum(deliver) / len(deliver))
    notes.append(f"latency: a group reaches its server {1000 * latency.admit_s:.1f} ms after its admission and the "
                 f"controller {1000 * latency.deliver_s:.1f} ms after its last answer, the means over the "
                 f"{len(admit)} groups the ledgers time (the HTTP legs to and from the server not included)")
    return latency


def _sharing(runs: list[RunFacts], costs: Costs, base: Costs, notes: list[str]) -> Costs:
    """With synchronous or colocated runs (η = 0, or one set of devices: generation and training
    take turns) besides asynchronous ones (they overlap): each side's costs alone from the former,
    and how much more it costs in the asynchronous ones (`shared_slowdown`). On one machine the two
    share caches and memory bandwidth, and the light processes take turns with both; on separate
    accelerators the slowdowns come out about 0."""
    shared = [r for r in runs if r.overlaps]
    alone = [r for r in runs if not r.overlaps]
    quiet: list[str] = []
    gen = _counted_generation(alone, base, quiet) if alone and shared else None
    if gen is None:
        notes.append("sharing: no synchronous or colocated run besides asynchronous ones (with the servers' compute "
                     "counts); the costs hold what sharing the machine costs, and shared_slowdown is 0")
        return costs
    train = _train(alone, base, quiet)
    # Each side is slowed only while the other works, as the simulation applies it: a step row's
    # excess over the costs alone is slowdown × the costs alone × the share of the step the other
    # side was at work (the trainer's train_seconds, the servers' 1 − generator_idle).
    decode = [(s, _overlap(s)) for r in shared for s in r.steps if s.get("gen/decode_steps")]
    over = sum(_decode_alone_seconds(gen, s) * f for s, f in decode)
    extra = sum(s["gen/decode_seconds"] - _decode_alone_seconds(gen, s) for s, _ in decode)
    gen_slowdown = max(0.0, extra / over) if over else 0.0
    # Prefill: p0, p from every run, each shared run's prefill seconds taken back to what they cost alone.
    prefills = [(s, 1 + gen_slowdown * _overlap(s) * r.overlaps) for r in runs for s in r.steps
                if s.get("gen/prefills")]
    p0, p = gen.prefill_fixed_s, gen.prefill_per_token_s
    if prefills:
        p0, p, _ = _prefill_least_squares(prefills, gen.step_fixed_s)
    steps = [(r, s) for r in shared for s in r.steps if s.get("train/n_tokens") and s.get("train_seconds")]
    train_alone = [(train.step_fixed_s + train.per_token_s * s["train/n_tokens"] / r.ppo_epochs
                    / (r.train_devices * train.dp_efficiency), s) for r, s in steps]
    over = sum(t * (1 - s["generator_idle"] if s.get("generator_idle") is not None else 1.0) for t, s in train_alone)
    extra = sum(s["train_seconds"] - (s.get("train/prox_seconds") or 0.0) - t for t, s in train_alone)
    train_slowdown = max(0.0, extra / over) if over else 0.0
    notes.append(f"sharing: alone (the {len(alone)} synchronous or colocated run(s)) a = {gen.step_fixed_s:.3g} s, "
                 f"b = {gen.step_per_seq_s:.3g} s, e = {gen.step_per_context_token_s:.3g} s, "
                 f"p0 = {p0:.3g} s, p = {p:.3g} s/{'position' if gen.padded else 'token'}, c = {train.step_fixed_s:.3g} s, "
                 f"d = {train.per_token_s:.3g} s/token; overlapping (the {len(shared)} asynchronous run(s)) "
                 f"a decode step costs {gen_slowdown:+.0%} and a train step {train_slowdown:+.0%}")
    return replace(
        costs,
        gen=replace(costs.gen, step_fixed_s=gen.step_fixed_s, step_per_seq_s=gen.step_per_seq_s,
                    step_per_context_token_s=gen.step_per_context_token_s, prefill_fixed_s=p0,
                    prefill_per_token_s=p, shared_slowdown=gen_slowdown),
        train=replace(costs.train, step_fixed_s=train.step_fixed_s, per_token_s=train.per_token_s,
                      shared_slowdown=train_slowdown),
    )


def fit_runs(paths: list[str], base: Costs) -> Fitted:
    """Costs fitted from the run directories' metrics, the rest from `base` (the cost file)."""
    runs = [read_run(p) for p in paths]
    first = runs[0]
    notes: list[str] = []
    rows = [s for r in runs for s in r.steps]
    answers = first.batch_size * first.group_size
    mean_len = sum(s.get("response_length", 0.0) for s in rows) / len(rows)
    top = first.max_new_tokens or base.lengths.max_new_tokens
    prompt = float(base.workload.prompt_tokens)
    with_tokens = [(r, s) for r in runs for s in r.steps if s.get("train/n_tokens") and "response_length" in s]
    if with_tokens and answers:
        prompt = max(0.0, sum(s["train/n_tokens"] / r.ppo_epochs / (r.batch_size * r.group_size) - s["response_length"]
                              for r, s in with_tokens) / len(with_tokens))
        notes.append(f"workload: prompt_tokens = {prompt:.0f}, from train/n_tokens less the answers")
    if any(r.groups for r in runs):
        lengths = Lengths(top, groups=tuple(g for r in runs for g in r.groups),
                          filtered_groups=tuple(g for r in runs for g in r.filtered_groups))
        notes.append(f"lengths: the answers of the {len(lengths.groups)} groups finished for training and "
                     f"{len(lengths.filtered_groups)} filtered, from the runs' ledgers ({lengths.describe()}): "
                     "each simulated group is a recorded one of its fate, drawn whole")
    else:
        lengths = _lengths(rows, _generated_mean(runs, notes) or mean_len, top, answers, base, notes)
    workload = replace(base.workload, batch_size=first.batch_size or base.workload.batch_size,
                       group_size=first.group_size or base.workload.group_size, prompt_tokens=round(prompt),
                       max_concurrent=first.max_concurrent, interrupt=first.interrupt,
                       filtered_fraction=_filtered(runs, notes))
    costs = Costs(gen=_generation(runs, base, prompt, mean_len, notes), train=_train(runs, base, notes),
                  update=_update(runs, base, notes), workload=workload, lengths=lengths, latency=_latency(runs, base, notes))
    costs = _sharing(runs, costs, base, notes)
    return Fitted(costs, notes, (first.gen_devices, first.train_devices), first.eta, first.colocated)
