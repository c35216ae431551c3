"""training/join.py: a trainer rank joins the key of a node on a mesh of its own to its groups, by
group id, whichever of the group and the result arrives first; only complete groups leave."""

import numpy as np
import pytest

from areal_flow.training.join import DuplicateResult, Join, JoinError, Remote
from areal_flow.transport.messages import Array, Inferred, InferRequest, Ready, Sample, ScoredGroup, decode, encode

REF = Remote("ref", "ref_logprobs", "output_ids")


def group(group_id: int, lengths=(3, 2)) -> ScoredGroup:
    return ScoredGroup(group_id, [
        Sample(uid=f"g{group_id}-{i}", prompt_id="p", group_id=group_id, index=i, birth_time=0.0,
               arrays={"prompt_ids": Array.of(np.arange(2, dtype=np.int32)),
                       "output_ids": Array.of(np.arange(n, dtype=np.int32))}, scalars={"rewards": 1.0})
        for i, n in enumerate(lengths)])


def result(group_id: int, lengths=(3, 2), indices=None, node="ref", key="ref_logprobs") -> Inferred:
    indices = list(range(len(lengths))) if indices is None else indices
    return Inferred(group_id, node, key, indices, [Array.of(np.full(n, -0.5 - i, dtype=np.float32))
                                                   for i, n in zip(indices, lengths)], "ref_infer0", seconds=0.5)


def test_the_messages_travel_and_decode_as_they_were_sent():
    request = InferRequest(7, 1, "ref", [1, 0], [{"output_ids": Array.of(np.array([4, 5], dtype=np.int32))}] * 2)
    for msg in (request, result(7), Ready("ref_infer0")):
        assert decode(encode(msg)) == msg
    assert decode(encode(request)).inputs[0]["output_ids"].numpy().tolist() == [4, 5]


def test_a_result_before_its_group_waits_for_it():
    join = Join([REF])
    assert join.result(result(3)) is None and 3 in join.results and not join.pending
    done = join.group(group(3))
    assert done is not None and done.group_id == 3 and not join.pending and not join.results
    assert [s.array("ref_logprobs").tolist() for s in done.samples] == [[-0.5] * 3, [-1.5] * 2]
    assert [s.scalars["ref_seconds"] for s in done.samples] == [0.25, 0.25]  # the group's share, per sample


def test_a_group_before_its_result_waits_in_pending_and_names_what_it_waits_for():
    join = Join([REF])
    assert join.group(group(4)) is None and 4 in join.pending
    assert join.waiting_for(4) == [REF] and join.waiting_for(5) == []
    done = join.result(result(4, indices=[1, 0], lengths=(2, 3)))  # samples in another order
    assert done is not None and not join.pending
    assert [len(s.array("ref_logprobs")) for s in done.samples] == [3, 2]


def test_a_timeout_names_the_missing_groups_and_the_key_a_pending_group_waits_for_with_its_replica():
    join = Join([REF])
    join.group(group(5))
    assert join.lacking([3, 5, 4], {"ref": 2}) == [
        "groups [3, 4], which never arrived on its inbox",
        "group 5, which arrived without its ref_logprobs (graph.ref), never sent by ref_infer1"]
    assert Join([]).lacking([7], {}) == ["groups [7], which never arrived on its inbox"]  # as before


def test_a_second_result_for_a_group_is_a_duplicate():
    join = Join([REF])
    join.result(result(5))
    with pytest.raises(DuplicateResult, match="group 5: a second ref_logprobs from node 'ref'"):
        join.result(result(5))
    assert join.group(group(5)) is not None
    with pytest.raises(DuplicateResult):  # and after the group was completed
        join.result(result(5))
    assert not join.results


def test_a_result_that_does_not_fit_its_group_is_refused_naming_group_node_and_key():
    join = Join([REF])
    join.group(group(6))
    with pytest.raises(JoinError) as e:
        join.result(result(6, lengths=(3, 4)))
    assert str(e.value) == ("group 6: node 'ref' (ref_infer0) sent ref_logprobs of 4 values for sample 1, whose "
                            "output_ids has 2")
    assert all("ref_logprobs" not in s.arrays for s in join.pending[6].samples)  # nothing of it was applied
    join = Join([REF])
    join.group(group(8))
    with pytest.raises(JoinError, match=r"group 8: node 'ref' \(ref_infer0\) sent ref_logprobs for samples \[0\]"):
        join.result(result(8, lengths=(3,)))


def test_a_complete_group_skips_pending():
    join = Join([REF])
    moved = join.result(result(9)) or join.group(group(9))  # complete on one rank, then moved to another
    assert Join([REF]).group(moved) is moved
    assert Join([]).group(group(10)) is not None  # no node on a mesh of its own: every group is complete


def test_a_result_long_overdue_is_asked_for_again_once_per_interval_and_a_late_duplicate_is_dropped():
    join = Join([REF])
    join.group(group(5), now=100.0)
    join.group(group(6), now=108.0)
    assert join.overdue(105.0, after=10.0) == []  # not yet
    late = join.overdue(111.0, after=10.0)
    assert [(g.group_id, r) for g, r in late] == [(5, REF)]
    assert join.overdue(115.0, after=10.0) == []  # asked again at 111: the next ask is due after 121
    assert [g.group_id for g, _ in join.overdue(122.0, after=10.0)] == [5, 6]
    # The request a group is asked again with carries the node's inputs of every sample.
    request = InferRequest.for_group(late[0][0], 1, "ref", ["output_ids"])
    assert (request.group_id, request.rank, request.indices) == (5, 1, [0, 1])
    assert [x["output_ids"].numpy().tolist() for x in request.inputs] == [[0, 1, 2], [0, 1]]
    # Both answers come: the first completes the group, the second is a duplicate, dropped.
    assert join.result(result(5)).group_id == 5 and 5 not in join.asked
    with pytest.raises(DuplicateResult):
        join.result(result(5))
    assert [g.group_id for g, _ in join.overdue(1000.0, after=10.0)] == [6]
