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

from dataclasses import dataclass, replace
from statistics import median
from typing import Any

from areal_flow.advise.costs import Costs, Latency, Lengths, lognormal_from_max, lognormal_from_truncation
from areal_flow.advise.fit_generation import (
    counted_generation,
    decode_alone_seconds,
    fit_generation,
    line_fit,
    prefill_least_squares,
    train_share,
)
from areal_flow.advise.runs import RunFacts, read_run

TOKEN_PHASES = ("packing", "forward", "backward", "forward_backward")
"""The trainer's phases (metrics/profile.py) whose time scales with the tokens of a step."""


@dataclass(frozen=True)
class Fitted:
    """The costs to simulate with, what each came from, and the run's own allocation."""

    costs: Costs
    notes: list[str]
    split: tuple[int, int]
    eta: int
    colocated: bool = False
    """the run's generation and training shared their devices (split: all of them, twice)."""


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
    elif (fit := line_fit(per_device, plain)) is not None and fit[0] >= 0 and fit[1] > 0:
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
    gen = counted_generation(alone, base, quiet) if alone and shared else None
    if gen is None:
        notes.append("sharing: no synchronous or colocated run besides asynchronous ones (with the servers' compute "
                     "counts); the costs hold what sharing the machine costs, and shared_slowdown is 0")
        return costs
    train = _train(alone, base, quiet)
    # Each side is slowed only while the other works, as the simulation applies it: a step row's
    # excess over the costs alone is slowdown × the costs alone × the share of the step the other
    # side was at work (the trainer's train_seconds, the servers' 1 − generator_idle).
    decode = [(s, train_share(s)) for r in shared for s in r.steps if s.get("gen/decode_steps")]
    over = sum(decode_alone_seconds(gen, s) * f for s, f in decode)
    extra = sum(s["gen/decode_seconds"] - decode_alone_seconds(gen, s) for s, _ in decode)
    gen_slowdown = max(0.0, extra / over) if over else 0.0
    # Prefill: p0, p from every run, each shared run's prefill seconds taken back to what they cost alone.
    prefills = [(s, 1 + gen_slowdown * train_share(s) * r.overlaps) for r in runs for s in r.steps
                if s.get("gen/prefills")]
    p0, p = gen.prefill_fixed_s, gen.prefill_per_token_s
    if prefills:
        p0, p, _ = prefill_least_squares(prefills, gen.step_fixed_s)
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
    costs = Costs(gen=fit_generation(runs, base, prompt, mean_len, notes), train=_train(runs, base, notes),
                  update=_update(runs, base, notes), workload=workload, lengths=lengths, latency=_latency(runs, base, notes))
    costs = _sharing(runs, costs, base, notes)
    return Fitted(costs, notes, (first.gen_devices, first.train_devices), first.eta, first.colocated)
