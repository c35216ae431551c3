"""First-fit-decreasing allocation of sequences to micro-batches under a token budget."""

from __future__ import annotations

from collections.abc import Sequence


def ffd_allocate(lengths: Sequence[int], max_tokens: int, min_groups: int = 1) -> list[list[int]]:
    """Group sequence indices so that each group's total length is at most `max_tokens`.

    lengths: [N] token counts. Returns a list of groups of indices into `lengths`; every index
    appears exactly once, and there are at least `min_groups` groups (empty ones when N < min_groups,
    because callers rely on the count, e.g. to run the same number of micro-batches on every rank).

    The rule, deterministic for equal inputs:
      1. Visit the indices by decreasing length (ties: lower index first).
      2. While there are fewer than `min_groups` groups, each item opens a new group, so the
         largest items are spread over the required groups.
      3. Otherwise the item joins the first (oldest) group it fits in: classic first-fit
         decreasing, which uses at most 11/9·OPT + 6/9 groups. AReaL instead picks the fitting
         group with the fewest items; that balances the groups but can need more of them (e.g.
         lengths 6,5,4,3,2 under 10: three groups instead of two), and a step's total work is the
         same however it is spread, so fewer forward passes win.
      4. If it fits nowhere it opens a new group. A sequence longer than `max_tokens` therefore sits
         alone in its own group: it is never dropped, the caller decides what that costs.

    With min_groups=1 a group opens only when nothing fits, so it never uses more groups than
    next-fit over the same order (each next-fit bin can start at most one new group here).
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if min_groups < 1:
        raise ValueError(f"min_groups must be >= 1, got {min_groups}")
    if any(n < 0 for n in lengths):
        raise ValueError(f"lengths must be >= 0, got {list(lengths)}")

    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    totals: list[int] = []
    for i in order:
        n = lengths[i]
        first_fit = next((g for g in range(len(groups)) if totals[g] + n <= max_tokens), None)
        if len(groups) < min_groups or first_fit is None:
            groups.append([i])
            totals.append(n)
        else:
            groups[first_fit].append(i)
            totals[first_fit] += n
    while len(groups) < min_groups:
        groups.append([])
    return groups
