"""A trainer rank's side of a critic on a mesh of its own: each process gets the groups it values,
a step is done once every process has trained it, and rank 0 alone reports the critic's stats."""

from types import SimpleNamespace

import numpy as np

from areal_flow.training.critic_link import CriticLink
from areal_flow.transport.messages import CriticSaved, CriticTrained, Sample, SaveCheckpoint, decode


class Inbox:
    """A socket that keeps what it is sent, decoded."""

    def __init__(self) -> None:
        self.got: list = []

    def send(self, data: bytes) -> None:
        self.got.append(decode(data))


GRAPH = SimpleNamespace(own_mesh_nodes=[SimpleNamespace(role="ref", name="ref"),
                                        SimpleNamespace(role="critic", name="values")])


def _link(rank: int = 0) -> tuple[CriticLink, list[Inbox]]:
    inboxes = [Inbox(), Inbox()]
    return CriticLink(GRAPH, {"ref": [Inbox()], "values": inboxes}, rank), inboxes


def test_each_process_gets_the_samples_of_the_groups_it_values_and_a_follower_sends_empty_shares():
    link, inboxes = _link(rank=1)
    assert link.workers == ["values_infer0", "values_infer1"]
    samples = [Sample(uid=f"u{g}", prompt_id="p", group_id=g, index=0, birth_time=0.0) for g in (0, 1, 2, 3)]
    seqs = [(np.array([g]), np.array([g, g])) for g in range(4)]
    data = {"returns": [np.full(2, float(g)) for g in range(4)]}
    link.send(5, samples, seqs, data, leader=True)
    for replica, inbox in enumerate(inboxes):
        (batch,) = inbox.got
        assert (batch.step, batch.rank) == (5, 1)
        assert batch.group_ids == [g for g in range(4) if g % 2 == replica]  # replica_of: by group id
        assert [p.numpy()[0] for p in batch.prompts] == batch.group_ids
        assert [r.numpy()[0] for r in batch.token_data["returns"]] == batch.group_ids
    link.send(6, samples, seqs, data, leader=False)
    assert all(inbox.got[-1].group_ids == [] and inbox.got[-1].step == 6 for inbox in inboxes)


def test_a_step_waits_for_every_process_and_only_rank_0_reports_the_stats():
    link, _ = _link(rank=0)
    assert link.update_missing(3) == ["the critic's update of step 4 from values_infer0",
                                      "the critic's update of step 4 from values_infer1"]
    link.received(CriticTrained(3, 4, {"loss": 0.5}, "values_infer1"))
    assert link.update_missing(3) == ["the critic's update of step 4 from values_infer0"]
    link.received(CriticTrained(3, 4, {"loss": 0.25}, "values_infer0"))
    assert link.update_missing(3) == []
    assert link.update_stats(3) == {"critic/loss": 0.25}  # the first process's, reduced already
    assert 3 not in link.trained
    follower, _ = _link(rank=1)
    follower.received(CriticTrained(3, 4, {"loss": 0.25}, "values_infer0"))
    assert follower.update_stats(3) == {}


def test_a_checkpoint_waits_for_every_process_to_write_its_part():
    link, inboxes = _link()
    msg = SaveCheckpoint(path="/ckpt/7", groups=[])
    link.ask_save(msg)
    assert all(inbox.got == [msg] for inbox in inboxes)
    link.received(CriticSaved("/ckpt/7", "values_infer0"))
    link.received(CriticSaved("/ckpt/other", "values_infer1"))
    assert link.save_missing("/ckpt/7") == ["the critic's part from values_infer1"]
    link.received(CriticSaved("/ckpt/7", "values_infer1"))
    assert link.save_missing("/ckpt/7") == []
    link.forget_save("/ckpt/7")
    assert link.saved == {("/ckpt/other", "values_infer1")}
