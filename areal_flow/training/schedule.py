"""Learning-rate schedules over optimizer steps, as a factor of the configured LR.

Warm-up is linear and counts the step being taken: step 0 of a 4-step warm-up runs at lr/4 and
step 3 at the full lr (Hugging Face's convention runs its first step at lr 0, which wastes it).
After warm-up, `linear` and `cosine` go from the full lr down to `min_ratio`·lr at `decay_steps`
and stay there; `constant` stays at the full lr.
"""

from __future__ import annotations

import math

SCHEDULES = ("constant", "linear", "cosine")


def lr_factor(step: int, schedule: str, warmup_steps: int = 0, decay_steps: int = 0, min_ratio: float = 0.0) -> float:
    """The LR factor of optimizer step `step` (counting from 0)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown LR schedule {schedule!r}; expected one of {SCHEDULES}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant" or decay_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (decay_steps - warmup_steps))
    shape = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * shape
