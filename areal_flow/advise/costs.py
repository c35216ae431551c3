"""What the advisor simulates with: per-token costs, the answer-length distribution, the workload
and the candidates to simulate (cost_file.py reads them from a cost file). Every bad value is an
`AdviseError` naming its key or file."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from statistics import NormalDist


class AdviseError(ValueError):
    """Bad input to the advisor; the message names the flag, key or file to fix."""


@dataclass(frozen=True)
class GenCosts:
    """One generation server: continuous batching, one token per running answer per decode step."""

    step_fixed_s: float = 0.005
    """a: seconds of one decode step whatever the batch (weights read, launch and scheduling overhead)."""
    step_per_seq_s: float = 8e-5
    """b: seconds each running answer adds to a decode step (its share of the matmuls, sampling; with
    step_per_context_token_s = 0 also its KV cache read at a typical context length)."""
    step_per_context_token_s: float = 0.0
    """e: seconds each token of context (prompt + answer so far) of a running answer adds to a decode
    step, its KV cache read; 0 = folded into b (what a run's metrics can fit)."""
    prefill_per_token_s: float = 1e-5
    """p: seconds per token prefilled: a new prompt (once per group), or prompt + tokens so far after an abort."""
    prefill_fixed_s: float = 0.0
    """p0: seconds of one prefill whatever its tokens (a forward's fixed overhead)."""
    max_running: int | None = None
    """most answers a server decodes at once (its KV memory); the rest wait in its queue; null = no limit."""
    join_group: int = 1
    """while answers run, queued ones join only once at least min(join_group, queued) of them have
    room (each join costs a prefill; the embedded engine: its max batch // 8); 1 = as soon as one can."""
    shared_slowdown: float = 0.0
    """fraction a decode step or prefill costs more while the trainer trains: generation and training
    on one machine share its caches and memory bandwidth (CPU cores); 0 on separate accelerators."""
    answer_s: float = 0.0
    """seconds a server spends handing one finished answer back before its next step (outside the
    decode step: the reply to its client shares the server's process)."""
    devices_per_server: int = 1
    """devices one server spans (tensor parallel size): a split's generation devices / this = servers."""
    padded: bool = False
    """the server pads a batch to its longest sequence (the embedded engine): a prefill costs p per
    position of its distinct sequences × the longest, a decode step e per running answer × the
    longest context; false: p and e per real token (SGLang's paged KV cache)."""


@dataclass(frozen=True)
class TrainCosts:
    """One train step on a batch: step_fixed_s + per_token_s · tokens / (devices · dp_efficiency)."""

    step_fixed_s: float = 1.0
    """c: seconds of a step whatever its size (optimizer step, saving the weights for the servers)."""
    per_token_s: float = 4e-5
    """d: seconds per trained token (prompt + answer) on one device, forward and backward."""
    prox_fraction: float = 0.0
    """extra per-token time of the π_prox forward, as a fraction of d, on steps that train a stale token."""
    dp_efficiency: float = 1.0
    """data-parallel efficiency: the per-token time divides by devices · this."""
    shared_slowdown: float = 0.0
    """fraction a train step costs more when it starts while generation runs (see GenCosts)."""


@dataclass(frozen=True)
class UpdateCosts:
    """Publishing a new policy version to the generation servers."""

    pause_s: float = 1.0
    """w: seconds the servers are paused while they load the new weights (not interrupting: after the drain)."""
    interrupt_pause_s: float | None = None
    """an interrupting update's pause (abort the running answers, load, continue); None: pause_s."""
    trainer_waits: bool = False
    """the trainer waits for each update before its next step (areal_flow's weights by broadcast or
    CUDA IPC: the trainer sends them); false: it trains the next step while the servers load (disk
    and shm weights)."""
    colocated_switch_s: float = 0.0
    """colocated: extra seconds per step to hand the devices over and back (the servers free their
    KV cache for the train step and take it back, the trainer empties its allocator), beyond the load."""


@dataclass(frozen=True)
class Lengths:
    """Answer lengths in tokens, clipped to [1, max_new_tokens]: recorded groups, an empirical
    list, or a lognormal given by its mean after clipping and its log-space sigma."""

    max_new_tokens: int
    values: tuple[int, ...] = ()
    """empirical lengths (drawn with replacement); empty: the lognormal below."""
    mean: float = 0.0
    """lognormal: the mean length after clipping at max_new_tokens."""
    sigma: float = 0.0
    """lognormal: the sigma of log(length), the tail; 0 = every answer has length `mean`."""
    groups: tuple[tuple[int, ...], ...] = ()
    """recorded prompt groups, each its answers' lengths (a run's ledger): a group is drawn whole,
    so its answers keep their spread; first before `values` and the lognormal."""
    filtered_groups: tuple[tuple[int, ...], ...] = ()
    """recorded groups that dynamic filtering dropped: a simulated group that is filtered is drawn
    from these (on tiny_arith the all-wrong groups' answers run long), the others from `groups`."""

    def __post_init__(self) -> None:
        if not self.values and not self.groups and not 0 < self.mean <= self.max_new_tokens:
            raise AdviseError(f"workload.lengths: mean {self.mean} must be in (0, max_new_tokens={self.max_new_tokens}]")

    @property
    def mu(self) -> float:
        """The lognormal's log-space mean that gives `mean` after clipping (bisection: monotone in mu)."""
        lo, hi = math.log(1.0) - 10 * self.sigma - 10, math.log(self.max_new_tokens) + 10 * self.sigma + 10
        for _ in range(200):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if _clipped_mean(mid, self.sigma, self.max_new_tokens) < self.mean else (lo, mid)
        return (lo + hi) / 2

    def group_sampler(self, rng: random.Random, size: int):
        """A function of `filtered` (whether dynamic filtering will drop the group) that draws the
        `size` answer lengths of one group: a recorded group of that fate whole when there are
        recorded groups of this size, else each answer on its own (`sampler`)."""
        top = self.max_new_tokens

        def clipped(gs: tuple[tuple[int, ...], ...]) -> list[list[int]]:
            return [[min(top, max(1, v)) for v in g] for g in gs if len(g) == size]

        kept = clipped(self.groups)
        dropped = clipped(self.filtered_groups) or kept
        if kept:
            return lambda filtered: list(rng.choice(dropped if filtered else kept))
        draw = self.sampler(rng)
        return lambda filtered: [draw() for _ in range(size)]

    def sampler(self, rng: random.Random):
        """A function of no arguments that draws one length."""
        top = self.max_new_tokens
        if self.groups and not self.values:  # another group size: the recorded answers one by one
            return replace(self, values=tuple(v for g in self.groups + self.filtered_groups for v in g)).sampler(rng)
        if self.values:
            values = [min(top, max(1, v)) for v in self.values]
            return lambda: rng.choice(values)
        if self.sigma == 0:
            return lambda: min(top, max(1, round(self.mean)))
        mu, sigma = self.mu, self.sigma
        return lambda: min(top, max(1, round(rng.lognormvariate(mu, sigma))))

    def describe(self) -> str:
        if self.groups:
            def mean(gs: tuple[tuple[int, ...], ...]) -> float:
                return sum(min(self.max_new_tokens, v) for g in gs for v in g) / max(1, sum(map(len, gs)))
            every = self.groups + self.filtered_groups
            top = sum(v >= self.max_new_tokens for g in every for v in g) / sum(map(len, every))
            text = f"recorded, {len(self.groups)} groups, mean {mean(self.groups):.0f}"
            if self.filtered_groups:
                text += f"; {len(self.filtered_groups)} filtered groups, mean {mean(self.filtered_groups):.0f}"
            return text + f"; {top:.1%} at max {self.max_new_tokens}"
        if self.values:
            v = [min(self.max_new_tokens, max(1, x)) for x in self.values]
            return (f"empirical, {len(v)} lengths, mean {sum(v) / len(v):.0f}, "
                    f"{sum(x >= self.max_new_tokens for x in v) / len(v):.1%} at max {self.max_new_tokens}")
        if self.sigma == 0:
            return f"constant {self.mean:.0f}"
        cut = 1 - NormalDist(self.mu, self.sigma).cdf(math.log(self.max_new_tokens))
        return f"lognormal, mean {self.mean:.0f} after clipping, sigma {self.sigma:.3g}, {cut:.1%} at max {self.max_new_tokens}"


def _clipped_mean(mu: float, sigma: float, top: float) -> float:
    """E[min(X, top)] for log X ~ N(mu, sigma²)."""
    if sigma == 0:
        return min(math.exp(mu), top)
    z = (math.log(top) - mu) / sigma
    below = math.exp(mu + sigma ** 2 / 2) * NormalDist().cdf(z - sigma)
    return below + top * (1 - NormalDist().cdf(z))


def lognormal_from_max(mean: float, mean_max: float, n: int, top: int, batches: int = 200) -> Lengths | None:
    """The lognormal with clipped mean `mean` whose longest of `n` answers is `mean_max` on average
    (a run's response_length and response_length_max, n answers a step), or None when they do not
    say. The tail is what a pipeline waits for (a synchronous step, a draining update), and the
    largest of a step's answers pins it where the spread does not: lengths bounded by the task
    have a lighter tail than the lognormal with the same spread."""
    if not 0 < mean < mean_max <= top or n < 2:
        return None

    def longest(sigma: float) -> float:
        draw = Lengths(top, mean=mean, sigma=sigma).sampler(random.Random(0))  # the same draws for every sigma
        return sum(max(draw() for _ in range(n)) for _ in range(batches)) / batches

    lo, hi = 1e-3, 3.0
    if not longest(lo) <= mean_max <= longest(hi):
        return None
    for _ in range(25):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if longest(mid) < mean_max else (lo, mid)
    return Lengths(top, mean=mean, sigma=(lo + hi) / 2)


def lognormal_from_truncation(mean: float, truncated: float, top: int) -> Lengths | None:
    """The lognormal with clipped mean `mean` and P(length ≥ top) = `truncated` (what a run's
    response_length and truncated_fraction say), or None when that does not pin sigma down."""
    if not 0 < truncated < 1 or not 0 < mean < top:
        return None
    z = NormalDist().inv_cdf(1 - truncated)

    def gap(sigma: float) -> float:
        return _clipped_mean(math.log(top) - z * sigma, sigma, top) - mean

    lo, hi = 1e-4, 5.0
    if gap(lo) * gap(hi) > 0:
        return None
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if gap(lo) * gap(mid) > 0 else (lo, mid)
    return Lengths(top, mean=mean, sigma=(lo + hi) / 2)


@dataclass(frozen=True)
class Workload:
    """What a step trains and how generation is admitted (recipe keys in comments)."""

    batch_size: int = 8
    """B: prompt groups per train step (algorithm.batch_size)."""
    group_size: int = 8
    """G: answers per prompt (algorithm.group_size)."""
    prompt_tokens: int = 100
    """tokens of one prompt."""
    max_concurrent: int | None = None
    """most groups generating at once (rollout.max_concurrent); null = only the staleness bound limits."""
    interrupt: bool = True
    """a weight update interrupts running answers (rollout.interrupt); false: each server drains first."""
    filtered_fraction: float = 0.0
    """share of finished groups dynamic filtering drops (algorithm.success_rate_range): each frees its
    admission slot and is never trained; below 1."""


@dataclass(frozen=True)
class Latency:
    """The control path's delays: while a finished group travels to the controller and its
    replacement to a server, that server decodes one group fewer."""

    admit_s: float = 0.0
    """seconds from the controller admitting a group to its request at a server (controller ->
    rollout worker -> HTTP)."""
    deliver_s: float = 0.0
    """seconds from a group's last answer to the controller counting it (the reply to the rollout
    worker, scoring by the reward worker, its metadata to the controller)."""


@dataclass(frozen=True)
class Costs:
    """Everything the simulator needs besides the candidate."""

    gen: GenCosts
    train: TrainCosts
    update: UpdateCosts
    workload: Workload
    lengths: Lengths
    latency: Latency = Latency()


@dataclass(frozen=True)
class Candidates:
    """Which allocations to simulate (each may be overridden by a flag of the same name)."""

    splits: tuple[tuple[int, int], ...] = ((1, 1),)
    """generation:training devices; with `devices`, ratios scaled to that many devices."""
    etas: tuple[int, ...] = (0, 1, 2, 4, 8)
    """values of η (rollout.max_staleness)."""
    devices: int | None = None
    """total devices: the splits are ratios of it."""
    colocated: bool = True
    """also simulate generation and training colocated on all the devices, taking turns, at each η
    (docs/colocation.md); the only candidate on one device."""
