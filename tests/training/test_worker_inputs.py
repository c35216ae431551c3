"""What the trainer rank does with the loss inputs (algorithms/inputs.py builds them): the engine's
per-token data, the minibatch split, the optimizer schedule."""

import numpy as np

from areal_flow.algorithms.inputs import TrainInputs
from areal_flow.config.schema import AlgorithmConfig, RunConfig
from areal_flow.training.build import optim_spec
from areal_flow.training.engine import LOSS_MASK_KEY, LOSS_SHARE_KEY
from areal_flow.training.updates import engine_data, minibatches


def algo(**changes) -> AlgorithmConfig:
    return AlgorithmConfig(**{"group_size": 2, **changes})


def test_the_engine_gets_the_loss_mask_and_shares_under_its_keys_only_when_they_are_set():
    seqs = [(np.array([1]), np.array([2, 3]))]
    data = {"behav_logprobs": [np.zeros(2)], "advantages": [np.ones(2)], "token_weights": [np.full(2, 0.5)]}
    mask, share = [np.array([True, False])], [np.full(2, 0.5)]
    full = engine_data(TrainInputs(seqs, data, loss_mask=mask, loss_share=share))
    assert list(full) == ["behav_logprobs", "advantages", "token_weights", LOSS_SHARE_KEY, LOSS_MASK_KEY]
    assert full[LOSS_MASK_KEY] is mask and full[LOSS_SHARE_KEY] is share
    assert list(engine_data(TrainInputs(seqs, data))) == list(data)  # every token counts, once
    assert LOSS_MASK_KEY not in data  # the inputs' own dict is left alone


def test_minibatches_split_by_whole_groups_and_repeat_per_epoch():
    group_ids = [3, 3, 1, 1, 2, 2, 5, 5]  # as samples arrive, not sorted
    one = minibatches(group_ids, n_minibatches=2, epochs=1)
    assert one == [[2, 3, 4, 5], [0, 1, 6, 7]]  # groups {1, 2} then {3, 5}: whole groups, each sample once
    assert minibatches(group_ids, n_minibatches=2, epochs=3) == one * 3
    assert minibatches(group_ids, n_minibatches=1, epochs=2) == [list(range(8))] * 2
    # More minibatches than groups: the extra ones are empty (the engine still joins the collectives).
    assert minibatches([0, 0], n_minibatches=2, epochs=1) == [[0, 1], []]


def test_the_lr_schedule_spans_every_optimizer_step_of_the_run():
    cfg = RunConfig(total_steps=10, algorithm=algo(n_minibatches=2, ppo_epochs=3, lr_schedule="linear"))
    assert optim_spec(cfg).decay_steps == 60
