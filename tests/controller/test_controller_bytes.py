"""The controller handles metadata only: what it sends does not grow with the samples' length.

Each sample's token data travels rollout worker -> reward worker -> trainer rank (and rank to rank
when a step's plan moves a group); the controller sees sizes, versions and rewards, and answers
with routes, step plans and prompts.
"""

import numpy as np
import pytest

from areal_flow.controller.intake import Intake
from areal_flow.controller.trainer_pool import plan_step
from areal_flow.transport.messages import (Admitted, Array, Finish, GroupMeta, PromptGroup, Route, Sample, SampleMeta,
                                           ScoredGroup, decode, encode)

G, N_GROUPS, PROMPT = 4, 8, 20
PER_ANSWER_TOKEN = ["output_ids", "behav_logprobs", "versions"]


def group_meta(gid: int, answer: int) -> GroupMeta:
    samples = [SampleMeta(f"g{gid}-{i}", i, {"prompt_ids": PROMPT, **{k: answer for k in PER_ANSWER_TOKEN}},
                          {3: answer}, {"rewards": float(i % 2)}, Finish.STOP) for i in range(G)]
    return GroupMeta(gid, "reward0", samples, traffic={"rollout0": 654_321, "reward0": 123_456})


def controller_messages(answer: int) -> list:
    """Every message the controller sends for one batch of N_GROUPS groups with `answer` tokens
    per answer: the admitted prompts, a route per group, and the step's RunSteps for two ranks."""
    intake = Intake(G, 2, token_keys=["prompt_ids", *PER_ANSWER_TOKEN], output_keys=list(PER_ANSWER_TOKEN),
                    prompt_key="prompt_ids", reward_key="rewards")
    sent = [Admitted([PromptGroup(g, f"p{g}", {"id": f"p{g}", "prompt": "What is 2 + 3?", "answer": "5"}, G,
                                  1_700_000_000.0) for g in range(N_GROUPS)])]
    for g in range(N_GROUPS):
        rank, problem = intake.accept(group_meta(g, answer))
        assert problem is None
        sent.append(Route(g, rank))
    # The batch is the groups that rank 0 holds, so the plan moves some of them to rank 1.
    batch = intake.take([g for g, r in sorted(intake.location.items()) if r == 0])
    plans = plan_step(0, {g: (rank, tokens) for g, (_, rank, tokens) in batch.items()}, 2)
    assert any(p.moves for p in plans)  # the plan exercises moves, not only groups
    return sent + plans


def test_every_message_the_controller_sends_has_the_same_bytes_for_10_and_10000_answer_tokens():
    short, long = controller_messages(10), controller_messages(10_000)
    assert [type(m) for m in short] == [type(m) for m in long]
    assert [len(encode(m)) for m in short] == [len(encode(m)) for m in long]
    assert [encode(m) for m in short] == [encode(m) for m in long]  # the very same bytes, in fact
    assert [decode(encode(m)) for m in long] == long


def test_group_metadata_carries_lengths_not_tokens():
    size = {n: len(encode(group_meta(0, n))) for n in (10, 1_000, 10_000, 60_000)}
    # Lengths and version counts are integers: the same msgpack width from 256 to 65535 ...
    assert size[1_000] == size[10_000] == size[60_000]
    # ... and 10 fits in one byte where 10,000 takes three: 2 bytes more per integer that counts
    # answer tokens (3 lengths + 1 version count per sample), whatever the answer's length.
    assert size[10_000] - size[10] == 2 * (len(PER_ANSWER_TOKEN) + 1) * G


def scored_group(n: int) -> ScoredGroup:
    return ScoredGroup(0, [Sample(uid=f"g0-{i}", prompt_id="p0", group_id=0, index=i, birth_time=0.0,
                                  arrays={"prompt_ids": Array.of(np.arange(PROMPT, dtype=np.int32)),
                                          **{k: Array.of(np.arange(n, dtype=np.int32)) for k in PER_ANSWER_TOKEN}},
                                  scalars={"rewards": 1.0}) for i in range(G)])


def test_the_samples_themselves_grow_with_the_answer_which_is_why_they_travel_around_the_controller():
    short, long = len(encode(scored_group(10))), len(encode(scored_group(10_000)))
    grown = 4 * (10_000 - 10) * len(PER_ANSWER_TOKEN) * G  # int32 per answer token, per array, per sample
    assert long - short == pytest.approx(grown, rel=0.001)
    assert long > 100 * len(encode(group_meta(0, 10_000)))
