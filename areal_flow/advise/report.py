"""The advisor's answer: the recommended candidate, a rich table of every prediction, a plot."""

from __future__ import annotations

from rich.table import Table

from areal_flow.advise.costs import Costs
from areal_flow.advise.prediction import Prediction


def recommend(preds: list[Prediction], tolerance: float = 0.01) -> Prediction:
    """The highest trained samples/s; among those within `tolerance` of it, the least stale
    (mean realised staleness, then η)."""
    best = max(p.samples_per_s for p in preds)
    close = [p for p in preds if p.samples_per_s >= best * (1 - tolerance)]
    return min(close, key=lambda p: (p.staleness_mean, p.candidate.eta, -p.samples_per_s))


def sync_baseline(pred: Prediction, preds: list[Prediction]) -> Prediction | None:
    """What `pred` is compared with: the synchronous colocated run (η = 0) on as many devices, else
    η = 0 on the same split."""
    c = pred.candidate
    total = c.gen_devices if c.colocated else c.gen_devices + c.train_devices
    colocated = [p for p in preds
                 if p.candidate.colocated and p.candidate.eta == 0 and p.candidate.gen_devices == total]
    if colocated:
        return colocated[0]
    same = [p for p in preds if not p.candidate.colocated and p.candidate.eta == 0
            and (p.candidate.gen_devices, p.candidate.train_devices, p.candidate.interrupt)
            == (c.gen_devices, c.train_devices, c.interrupt)]
    return same[0] if same else None


def costs_table(costs: Costs) -> Table:
    """The costs the simulation used, with their symbols in docs/advise.md."""
    g, t, u, w = costs.gen, costs.train, costs.update, costs.workload
    table = Table(title="costs simulated", show_header=True, header_style="bold")
    table.add_column("what")
    table.add_column("value", justify="right")
    rows = [
        ("a: decode step, fixed", f"{g.step_fixed_s:.3g} s"),
        ("b: decode step, per running answer", f"{g.step_per_seq_s:.3g} s"),
        ("e: decode step, per context token", f"{g.step_per_context_token_s:.3g} s"),
        ("p: prefill, per token", f"{g.prefill_per_token_s:.3g} s"),
        ("p0: prefill, fixed", f"{g.prefill_fixed_s:.3g} s"),
        ("handing back an answer", f"{g.answer_s * 1000:.3g} ms"),
        ("answers a server runs at most", "no limit" if g.max_running is None else str(g.max_running)),
        ("queued answers join a running batch by", str(g.join_group)),
        ("devices per server", str(g.devices_per_server)),
        ("generation while the trainer trains", f"{g.shared_slowdown:+.0%}"),
        ("c: train step, fixed", f"{t.step_fixed_s:.3g} s"),
        ("d: train, per token on one device", f"{t.per_token_s:.3g} s"),
        ("prox forward (stale steps), × d", f"{t.prox_fraction:.3g}"),
        ("data-parallel efficiency", f"{t.dp_efficiency:.3g}"),
        ("a train step begun while generating", f"{t.shared_slowdown:+.0%}"),
        ("w: weight update pause", f"{u.pause_s:.3g} s"),
        ("interrupting update pause", "w" if u.interrupt_pause_s is None else f"{u.interrupt_pause_s:.3g} s"),
        ("trainer during an update", "waits" if u.trainer_waits else "trains the next step"),
        ("colocated switch per step", f"{u.colocated_switch_s:.3g} s"),
        ("batch", f"{w.batch_size} prompts × {w.group_size} answers"),
        ("prompt tokens", str(w.prompt_tokens)),
        ("max concurrent groups", "η only" if w.max_concurrent is None else str(w.max_concurrent)),
        ("groups dropped by dynamic filtering", f"{w.filtered_fraction:.0%}"),
        ("answer lengths", costs.lengths.describe()),
        ("admission to a server", f"{costs.latency.admit_s * 1000:.3g} ms"),
        ("last answer to the controller", f"{costs.latency.deliver_s * 1000:.3g} ms"),
    ]
    for what, value in rows:
        table.add_row(what, value)
    return table


def predictions_table(preds: list[Prediction], best: Prediction) -> Table:
    """One row per candidate; the recommended one in bold green."""
    table = Table(title="predicted (simulated)", header_style="bold")
    table.add_column("gen:train", no_wrap=True)
    for name in ("η", "interrupt", "samples/s", "tokens/s", "× sync", "step s", "gen idle", "train idle",
                 "stale mean", "stale max"):
        table.add_column(name, justify="left" if name == "interrupt" else "right")
    for p in preds:
        base = sync_baseline(p, preds)
        c = p.candidate
        table.add_row(
            c.label, str(c.eta), "yes" if c.interrupt else "no",
            f"{p.samples_per_s:.4g}", f"{p.tokens_per_s:,.0f}",
            f"{p.samples_per_s / base.samples_per_s:.2f}×" if base else "—",
            f"{p.step_s:.3g}", f"{p.gen_idle:.0%}", f"{p.train_idle:.0%}",
            f"{p.staleness_mean:.2f}", str(p.staleness_max),
            style="bold green" if p is best else None,
        )
    return table


def plot(preds: list[Prediction], path: str, title: str = "") -> None:
    """Trained samples/s against η, one line per split (and interrupt setting); colocated dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    lines: dict[tuple, list[Prediction]] = {}
    for p in preds:
        c = p.candidate
        lines.setdefault((c.gen_devices, c.train_devices, c.interrupt, c.colocated), []).append(p)
    interrupts = {k[2] for k in lines if not k[3]}
    for (gen, train, interrupt, colocated), ps in lines.items():
        ps = sorted(ps, key=lambda p: p.candidate.eta)
        label = ps[0].candidate.label + ("" if colocated or len(interrupts) == 1 else
                                         (" interrupt" if interrupt else " drain"))
        ax.plot([p.candidate.eta for p in ps], [p.samples_per_s for p in ps], marker="o", label=label,
                **({"linestyle": "--", "color": "grey"} if colocated else {}))
    ax.set_xlabel("η (rollout.max_staleness)")
    ax.set_ylabel("trained samples / s")
    ax.set_title(title or "predicted throughput", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
