"""The generation servers' costs fitted from runs (fit.py has the table of what comes from what):
from the servers' own compute counts where the runs have them (the embedded engine's `gen/*`),
else from their busy time against the running answers (SGLang)."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np

from areal_flow.advise.costs import Costs
from areal_flow.advise.runs import RunFacts
from areal_flow.generation.compute_counts import COMPUTE_COUNTS


def line_fit(xs: list[float], ys: list[float], ws: list[float] | None = None) -> tuple[float, float] | None:
    """Weighted least squares y = intercept + slope·x; None when x does not vary (≤ 5% of its mean)."""
    ws = ws or [1.0] * len(xs)
    sw = sum(ws)
    mx, my = sum(w * x for w, x in zip(ws, xs)) / sw, sum(w * y for w, y in zip(ws, ys)) / sw
    var = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs)) / sw
    if len(xs) < 2 or math.sqrt(var) <= 0.05 * abs(mx):
        return None
    slope = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys)) / (sw * var)
    return my - slope * mx, slope


def counted_generation(runs: list[RunFacts], base: Costs, notes: list[str]) -> Any | None:
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
        p0, p, how = prefill_least_squares([(s, 1.0) for s in rows], a)
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


def prefill_least_squares(rows: list[tuple[dict, float]], a: float) -> tuple[float, float, str]:
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


def train_share(row: dict) -> float:
    """The share of a step row's time the trainer trained."""
    if not row.get("step_seconds") or row.get("train_seconds") is None:
        return 1.0
    return min(1.0, row["train_seconds"] / row["step_seconds"])


def decode_alone_seconds(gen: Any, row: dict) -> float:
    """What a step row's counted decode steps cost at `gen`'s a, b, e."""
    return (gen.step_fixed_s * row["gen/decode_steps"] + gen.step_per_seq_s * row["gen/decode_rows"]
            + gen.step_per_context_token_s * row.get("gen/decode_kv", 0.0))


def fit_generation(runs: list[RunFacts], base: Costs, prompt: float, mean_len: float, notes: list[str]) -> Any:
    """From the servers' compute counts where the runs have them; else a and b from runs that do
    not interrupt (an interrupting run's busy time includes re-prefills), then p from the
    interrupting runs' busy time beyond them."""
    first = runs[0]
    placement = {"max_running": first.max_running, "join_group": first.join_group,
                 "devices_per_server": max(1, first.gen_devices // first.servers)}
    if (counted := counted_generation(runs, base, notes)) is not None:
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
    fit = line_fit([1 / p[2] for p in plain], [p[0] / p[1] for p in plain], [p[1] for p in plain])
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
