"""The trainer pool: which rank trains which group of a step, and what the ranks report back.

Scored groups already sit on trainer ranks (intake.py routed them). A step's plan keeps each group
where it is unless moving it evens out the tokens the ranks train: only those groups travel, rank
to rank. Pure functions of metadata, tested without sockets.
"""

from __future__ import annotations

from areal_flow.transport.messages import RunStep, StepDone


def balance(where: dict[int, tuple[int, int]], n_ranks: int) -> dict[int, int]:
    """group id -> rank, from `where` (group id -> (rank holding it, tokens)).

    Starting from where the groups are, repeatedly move one group from the most loaded rank to the
    least loaded one while that lowers the larger of the two loads, choosing the group that evens
    them best. Every move lowers the sum of squared loads, so it stops; it never moves a group that
    does not help, so balanced input moves nothing. A greedy heuristic: it neither swaps groups nor
    searches for the fewest moves (tests/controller/test_trainer_pool.py shows cases it misses),
    which matters little here because intake already routes each group to the least loaded rank.
    """
    assign = {g: rank for g, (rank, _) in where.items()}
    tokens = {g: t for g, (_, t) in where.items()}
    load = [0] * n_ranks
    for g, rank in assign.items():
        load[rank] += tokens[g]
    while True:
        hi = max(range(n_ranks), key=lambda r: (load[r], -r))
        lo = min(range(n_ranks), key=lambda r: (load[r], r))
        gap = load[hi] - load[lo]
        movable = [g for g in sorted(assign) if assign[g] == hi and 0 < tokens[g] < gap]
        if not movable:
            return assign
        g = min(movable, key=lambda g: abs(gap - 2 * tokens[g]))
        assign[g] = lo
        load[hi] -= tokens[g]
        load[lo] += tokens[g]


def plan_step(step: int, where: dict[int, tuple[int, int]], n_ranks: int) -> list[RunStep]:
    """One RunStep per rank: the groups it trains, and the groups it holds that go elsewhere."""
    assign = balance(where, n_ranks)
    plans = [RunStep(step=step, groups=[], moves={}) for _ in range(n_ranks)]
    for g in sorted(assign):
        rank, holder = assign[g], where[g][0]
        plans[rank].groups.append(g)
        if holder != rank:
            plans[holder].moves[g] = rank
    return plans


def merge_results(done: list[StepDone]) -> tuple[dict[str, float], str]:
    """(stats, new weights' path) of a step from every rank's StepDone. The engine already reduces
    the train statistics over the ranks; rank 0 publishes the weights."""
    first = min(done, key=lambda d: d.rank)
    return dict(first.stats), first.weights_path
