"""A trained node's optimizer steps over a step's batch, and what they are fed.

Each epoch over the batch is split into `n_minibatches` by whole groups (`minibatches`): a group's
advantages are normalised together, so they train in one update. The engine gets the loss
inputs as per-token arrays (`engine_data`), the loss mask and the denominator shares under the
keys it reads them by. Batch-level statistics (advantages, the length-bias diagnostic) are summed
over the data-parallel ranks with `all_reduce_over`.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from areal_flow.algorithms.diagnostics import length_bucket_sums, stalest_shares
from areal_flow.algorithms.inputs import TrainInputs
from areal_flow.algorithms.library import AllReduce
from areal_flow.training.engine import LOSS_MASK_KEY, LOSS_SHARE_KEY, Engine
from areal_flow.training.step_stats import accumulate_stats


def all_reduce_over(group: dist.ProcessGroup | None) -> AllReduce | None:
    """A sum of a small tensor over `group` (every rank calls it at the same point), for the
    batch-level statistics of advantages; None when the batch is on this rank alone."""
    if group is None or dist.get_world_size(group) == 1:
        return None

    def reduce(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        dist.all_reduce(t, group=group)
        return t

    return reduce


def length_bias(inputs: TrainInputs, max_new_tokens: int, reduce: AllReduce | None) -> dict[str, float]:
    """The step's per-length-bucket sums of advantages and loss weights (diagnostics.length_bucket_sums)
    over the data-parallel ranks (`reduce`: their sum; every rank calls it, with or without samples)."""
    sums = length_bucket_sums([len(out) for _, out in inputs.seqs], inputs.advantages, inputs.valid_masks(),
                              inputs.token_data.get("token_weights"), max_new_tokens)
    if reduce is None:
        return sums
    total = reduce(torch.tensor(list(sums.values()), dtype=torch.float64))
    return dict(zip(sums, total.tolist()))


def train_update(engine: Engine, group_ids: list[int], seqs: list[tuple[np.ndarray, np.ndarray]],
                 token_data: dict[str, list[np.ndarray]], loss_fn, algo, skip: list[bool] | None = None,
                 first_loss_fn=None) -> dict[str, float]:
    """n_minibatches optimizer steps per epoch over the batch (each sample's group in `group_ids`),
    their stats added up; the sequences marked in `skip` are not run (Engine.train_step). The first
    optimizer step runs `first_loss_fn` when given (the policy's own logprobs at the step's start)."""
    stats: dict[str, float] = {}
    each = []
    for n, idx in enumerate(minibatches(group_ids, algo.n_minibatches, algo.ppo_epochs)):
        each.append(engine.train_step(
            [seqs[i] for i in idx], {k: [v[i] for i in idx] for k, v in token_data.items()},
            first_loss_fn if n == 0 and first_loss_fn is not None else loss_fn,
            skip=None if skip is None else [skip[i] for i in idx]))
        accumulate_stats(stats, each[-1])
    stats.update(stalest_shares(each))  # the stalest tokens' share of each minibatch's gradient
    return stats


def engine_data(inputs: TrainInputs) -> dict[str, list[np.ndarray]]:
    """The per-token data Engine.train_step takes: the loss function's, and the loss mask and
    denominator shares under the keys the engine reads them by."""
    data = dict(inputs.token_data)
    if inputs.loss_share is not None:
        data[LOSS_SHARE_KEY] = inputs.loss_share
    if inputs.loss_mask is not None:
        data[LOSS_MASK_KEY] = inputs.loss_mask
    return data


def minibatches(group_ids: list[int], n_minibatches: int, epochs: int) -> list[list[int]]:
    """Sample indices of each optimizer step: `epochs` passes over the batch, each split into
    `n_minibatches` by whole groups (every group's advantages train in one update), in group order."""
    groups = sorted(set(group_ids))
    splits = [set(part.tolist()) for part in np.array_split(np.array(groups, dtype=np.int64), n_minibatches)]
    one_pass = [[i for i, g in enumerate(group_ids) if g in members] for members in splits]
    return one_pass * epochs
