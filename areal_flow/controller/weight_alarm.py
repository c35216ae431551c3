"""A run-time warning when staleness costs the decoupled objective its samples (docs/algorithms.md,
"Staleness diagnostics").

The behaviour weight w = π_prox/π_behav of a token sampled several versions ago can be far from 1;
past the bounds of algorithm.correction the token is masked or its weight truncated. When that
happens to a large share of the tokens, or the weights are so uneven that a few tokens carry the
step (a low effective sample size), for several steps in a row, the run says so once: on the
console (the launcher prints `warning` rows) and in the metrics, naming η and what to change.
"""

from __future__ import annotations

from dataclasses import dataclass

from areal_flow.algorithms.diagnostics import STALENESS_BUCKETS


@dataclass
class WeightAlarm:
    """Watches each step row's train/capped_fraction and train/ess_fraction."""

    capped_fraction: float  # warn above this share of tokens outside the bounds; 0 = never
    ess_fraction: float  # or below this effective sample size fraction; 0 = never
    steps: int  # in this many steps in a row
    eta: int
    in_a_row: int = 0
    raised: bool = False

    def trouble(self, row: dict) -> str | None:
        """What is wrong in this step's row, or None."""
        capped, ess = row.get("train/capped_fraction"), row.get("train/ess_fraction")
        if self.capped_fraction > 0 and capped is not None and capped > self.capped_fraction:
            return f"{100 * capped:.1f}% of the tokens had a behaviour weight π_prox/π_behav outside its bounds"
        if self.ess_fraction > 0 and ess is not None and ess < self.ess_fraction:
            return f"the behaviour weights' effective sample size was {100 * ess:.0f}% of the tokens"
        return None

    def observe(self, row: dict) -> str | None:
        """The warning's message the first time `steps` rows in a row are in trouble, else None."""
        problem = self.trouble(row)
        self.in_a_row = self.in_a_row + 1 if problem else 0
        if self.raised or problem is None or self.in_a_row < self.steps:
            return None
        self.raised = True
        stalest = max((k.split("/")[2] for k in row if k.startswith("train/stale/") and k.endswith("/tokens")),
                      key=STALENESS_BUCKETS.index, default=None)
        where = f"; the stalest tokens ({stalest} versions behind)" if stalest else ""
        weight = row.get(f"train/stale/{stalest}/weight_mean") if stalest else None
        where += f" had a mean weight of {weight:.2f}" if weight is not None else ""
        steps = f"{self.steps} steps in a row" if self.steps > 1 else "a step"
        return (f"staleness: {problem} ({steps}){where}. Samples up to "
                f"rollout.max_staleness={self.eta} versions old are too far from the policy for this run: lower "
                f"rollout.max_staleness, or lower algorithm.lr or algorithm.n_minibatches "
                f"(docs/algorithms.md, \"Staleness diagnostics\")")

