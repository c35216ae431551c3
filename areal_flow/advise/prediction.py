"""What the advisor simulates and what a simulation predicts: a `Candidate` allocation, the
`Prediction` of its throughput, idleness and staleness, and what a simulation records as it runs
(`Measured`) to predict from over its measured window (the steps after the warm-up)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace


@dataclass(frozen=True)
class Candidate:
    """One allocation to simulate."""

    gen_devices: int
    train_devices: int
    eta: int
    interrupt: bool = True
    colocated: bool = False
    """generation and training take turns on every device (`|` in an allocation): gen_devices =
    train_devices = all of them; interrupt must be true (the servers retract their answers)."""

    @property
    def label(self) -> str:
        if self.colocated:
            return f"colocated ({self.gen_devices})"
        return f"{self.gen_devices}:{self.train_devices}"


@dataclass(frozen=True)
class Prediction:
    """What the simulation predicts for a candidate, over its measured steps."""

    candidate: Candidate
    samples_per_s: float
    """trained answers per second."""
    tokens_per_s: float
    """trained tokens (prompt + answer) per second."""
    gen_idle: float
    """fraction of the time the mean generation server neither decodes nor prefills."""
    train_idle: float
    """fraction of the time the trainer does not train (waiting for a batch or for the weight update)."""
    staleness_mean: float
    """mean over trained tokens of step − version of the token."""
    staleness_max: int
    """largest step − version of any trained token, over every simulated step."""
    step_s: float
    """mean wall seconds of a step."""
    gen_tokens_per_busy_s: float
    """tokens a generation device decodes per second of decoding or prefilling (what a server's own
    throughput counter says while it is busy)."""
    steps: int


@dataclass
class Measured:
    """What a simulation records as it runs, step by step."""

    step_ends: list[float] = field(default_factory=list)  # when each step's update ended
    train_spans: list[tuple[float, float]] = field(default_factory=list)  # each train step's (start, end)
    step_tokens: list[int] = field(default_factory=list)  # each step's trained tokens, prompt + answer
    hist: list[dict[int, int]] = field(default_factory=list)  # per step: staleness -> trained tokens
    busy_marks: list[tuple[float, int]] = field(default_factory=list)
    """(mean server busy seconds, tokens decoded) at the measured window's two ends."""

    def prediction(self, cand: Candidate, warmup: int, total: int, gen_devices: int,
                   answers_per_step: int) -> Prediction:
        """The prediction over steps warmup + 1 .. total (`gen_devices`: the generation servers'
        devices; `answers_per_step`: B·G)."""
        t0 = self.step_ends[warmup - 1] if warmup else 0.0
        t1 = self.step_ends[-1]
        wall = t1 - t0
        measured = total - warmup
        train_busy = sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in self.train_spans)
        (busy0, decoded0), (busy1, decoded1) = self.busy_marks[0] if warmup else (0.0, 0), self.busy_marks[-1]
        gen_busy = busy1 - busy0
        tokens = sum(self.step_tokens[warmup:total])  # not a step begun after the last one ended
        window: dict[int, int] = {}
        for hist in self.hist[warmup:total]:
            for age, n in hist.items():
                window[age] = window.get(age, 0) + n
        trained = sum(window.values())
        return Prediction(
            candidate=cand,
            samples_per_s=measured * answers_per_step / wall if wall > 0 else math.inf,
            tokens_per_s=tokens / wall if wall > 0 else math.inf,
            gen_idle=1 - gen_busy / wall if wall > 0 else 0.0,
            train_idle=1 - train_busy / wall if wall > 0 else 0.0,
            staleness_mean=sum(a * n for a, n in window.items()) / trained if trained else 0.0,
            staleness_max=max((a for h in self.hist for a, n in h.items() if n), default=0),
            step_s=wall / measured,
            gen_tokens_per_busy_s=(decoded1 - decoded0) / (gen_busy * gen_devices) if gen_busy > 0 else math.inf,
            steps=measured,
        )


def mean_prediction(preds: list[Prediction]) -> Prediction:
    """Each figure's mean over simulations of one candidate (the largest staleness: the largest)."""
    if len(preds) == 1:
        return preds[0]
    means = {f.name: sum(getattr(p, f.name) for p in preds) / len(preds) for f in fields(Prediction)
             if f.name not in ("candidate", "staleness_max", "steps")}
    return replace(preds[0], **means, staleness_max=max(p.staleness_max for p in preds))
