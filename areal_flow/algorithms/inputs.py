"""A train node's loss inputs for one step, built from the samples a trainer rank holds.

`train_inputs` is pure: samples and the config in, a `TrainInputs` out. It knows no engine, socket
or process group; the one collective it needs (batch statistics of the advantages summed over the
data-parallel ranks) is passed in as `all_reduce`. The trainer (training/worker.py) calls it and
hands the result to its engine.

Every input is found by its declared meaning (graph/keys.py: `prompt_ids`, `behav_logprobs`, ...)
through `key`, which maps a meaning to the name the recipe gave it (the graph's `input` for the
train node), so this module does not depend on the graph.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from areal_flow.algorithms import library
from areal_flow.algorithms.kl import kl_estimate
from areal_flow.transport.messages import Finish, Sample

if TYPE_CHECKING:
    from areal_flow.config.schema import AlgorithmConfig

KeyOf = Callable[[str], "str | None"]
"""A well-known meaning ('rewards', 'ref_logprobs', ...) -> the sample key the train node reads
for it, or None when it reads none."""

Seq = tuple[np.ndarray, np.ndarray]
"""(prompt_ids, output_ids) of one answer."""

OPTIONAL_MEANINGS = ("ref_logprobs", "versions", "values")
"""Per-token inputs passed on whenever the train node reads them (prox_logprobs: only when the
step's π_prox comes from the prox node)."""


@dataclass(frozen=True)
class TrainInputs:
    """One step's loss inputs, one entry per answer, in the samples' order.

    `token_data` is what the loss function reads per answer token: `behav_logprobs`,
    `advantages`, `seq_ids` (the answer's index, for sequence-level ratios), and when present
    `ref_logprobs`, `versions`, `values` with `returns` (the critic's targets), `prox_logprobs`,
    `token_weights` (loss aggregations other than token-mean). `loss_mask` and `loss_share` are
    what the engine itself reads (the valid tokens, each token's share of the denominator); None
    means every token counts, and counts once."""

    seqs: list[Seq]
    token_data: dict[str, list[np.ndarray]]
    loss_mask: list[np.ndarray] | None = None
    loss_share: list[np.ndarray] | None = None

    @property
    def advantages(self) -> list[np.ndarray]:
        return self.token_data["advantages"]

    def valid_masks(self) -> list[np.ndarray]:
        """Each answer's loss mask, all True where no mask is set."""
        if self.loss_mask is not None:
            return self.loss_mask
        return [np.ones(len(b), dtype=bool) for b in self.token_data["behav_logprobs"]]

    def without_aggregation(self) -> TrainInputs:
        """The same inputs under a token mean (the critic's value loss: the policy's aggregation is
        not the critic's)."""
        data = {k: v for k, v in self.token_data.items() if k != "token_weights"}
        return dataclasses.replace(self, token_data=data, loss_share=None)


def train_inputs(samples: list[Sample], key: KeyOf, algo: AlgorithmConfig, *, prox_source: str | None = "data",
                 kl_coef: float = 0.0, all_reduce: library.AllReduce | None = None, roles: int = 1) -> TrainInputs:
    """The train node's inputs from `samples` sorted by (group, index) (whole groups).

    Advantages come from the configured pipeline (library.advantages: shaping, normalisation, KL
    as a reward, the estimator); with `mask_truncated`, answers cut at the length limit get a zero
    loss mask, and where the node reads `loss_mask` (multi-turn answers) the observation tokens get
    0 too: every statistic of the pipeline is over the policy's tokens alone. prox_logprobs are
    passed on only when `prox_source` is 'data' (the prox node's output is this step's π_prox).
    With an agent's `roles` (graph.<generate>.agent_roles), a group is that many blocks of samples,
    one a role (agents/runner.py: run_group), each normalised apart: a role's samples are compared
    with its own, never with another role's."""
    seqs = [(s.array(key("prompt_ids")), s.array(key("output_ids"))) for s in samples]
    truncated = [s.finish != Finish.STOP for s in samples]
    masks = [np.full(len(out), not (algo.mask_truncated and cut)) for (_, out), cut in zip(seqs, truncated)]
    if (mask_key := key("loss_mask")) is not None:
        masks = [m & (s.array(mask_key) != 0) for m, s in zip(masks, samples)]
    token_data = per_token_inputs(samples, key, prox_source)
    scores = torch.tensor([s.scalars[key("rewards")] for s in samples], dtype=torch.float32)
    kl = kl_rewards(token_data, algo, kl_coef)
    # Even without samples: a rank's batch statistics join the other ranks' all-reduce.
    blocks = dataclasses.replace(algo, group_size=algo.group_size // roles) if roles > 1 else algo
    token_data["advantages"], returns = library.advantages(scores, masks, truncated, blocks, kl=kl, kl_coef=kl_coef,
                                                           values=token_data.get("values"), all_reduce=all_reduce)
    if "values" in token_data:
        token_data["returns"] = returns  # the critic's targets
    token_data["seq_ids"] = [np.full(len(out), i, dtype=np.int64) for i, (_, out) in enumerate(seqs)]
    share = None
    if algo.loss_agg != "token-mean":
        token_data["token_weights"], share = library.aggregation(masks, algo)
    masked = algo.mask_truncated or mask_key is not None
    return TrainInputs(seqs, token_data, loss_mask=masks if masked else None, loss_share=share)


def per_token_inputs(samples: list[Sample], key: KeyOf, prox_source: str | None) -> dict[str, list[np.ndarray]]:
    """The per-answer-token arrays the train node reads, by meaning: behav_logprobs always, the
    others of OPTIONAL_MEANINGS (and prox_logprobs) where it reads them."""
    data = {"behav_logprobs": [s.array(key("behav_logprobs")) for s in samples]}
    meanings = list(OPTIONAL_MEANINGS) + (["prox_logprobs"] if prox_source == "data" else [])
    for meaning in meanings:
        if key(meaning) is not None:
            data[meaning] = [s.array(key(meaning)) for s in samples]
    return data


def kl_rewards(token_data: dict[str, list[np.ndarray]], algo: AlgorithmConfig,
               kl_coef: float) -> list[np.ndarray] | None:
    """Per token, the KL estimate of π_behav to π_ref that enters the rewards (kl_in=reward), or
    None when KL is not a reward this step. Masked tokens (observations, cut answers) get none of it:
    advantages.token_rewards adds the penalty on valid tokens only."""
    if algo.kl_in != "reward" or not kl_coef or "ref_logprobs" not in token_data:
        return None
    return [kl_estimate(torch.tensor(b), torch.tensor(r), torch.ones(len(b), dtype=torch.bool),
                        algo.kl_estimator, algo.kl_clamp).numpy()
            for b, r in zip(token_data["behav_logprobs"], token_data["ref_logprobs"])]
