"""Admission: which prompt group each free rollout slot gets, in which order, under the staleness
rule (controller/admission.py)."""

import json

from areal_flow.controller.admission import Admission
from areal_flow.controller.intake import Intake
from areal_flow.controller.ledger import Ledger
from areal_flow.controller.prompts import PromptStream
from areal_flow.controller.staleness import StalenessManager
from areal_flow.controller.state import RunState
from areal_flow.transport.messages import DROP, AdmitRequest

ROWS = [{"id": f"p{i}", "prompt": f"question {i}", "answer": str(i), "topic": f"t{i}"} for i in range(6)]


def admission(tmp_path, batch_size=2, max_staleness=0, max_concurrent=100, **kw) -> tuple[Admission, Ledger]:
    state = RunState(StalenessManager(batch_size, max_staleness, max_concurrent),
                     Intake(2, 1, ["prompt_ids"], ["output_ids"], "prompt_ids", "rewards"))
    ledger = Ledger(str(tmp_path / "ledger.jsonl"))
    return Admission(state, PromptStream(ROWS, seed=1), 3, ledger, **kw), ledger


def events(tmp_path, ledger) -> list[dict]:
    ledger.flush()
    return [json.loads(line) for line in (tmp_path / "ledger.jsonl").read_text().splitlines()]


def test_free_slots_take_new_prompts_in_the_streams_order_until_the_staleness_rule_closes(tmp_path):
    adm, ledger = admission(tmp_path, batch_size=2, max_staleness=1)  # (1 + 0 + 1) * 2 = 4 groups at version 0
    adm.joined(b"w0", AdmitRequest("rollout0", 3))
    adm.joined(b"w1", AdmitRequest("rollout1", 3))
    same = PromptStream(ROWS, seed=1)
    order = [same.next()["id"] for _ in range(4)]
    granted = adm.grant()
    assert sorted(len(groups) for groups in granted.values()) == [2, 2]  # spread over the workers
    groups = sorted((g for gs in granted.values() for g in gs), key=lambda g: g.group_id)
    assert [g.prompt_id for g in groups] == order and [g.group_id for g in groups] == [0, 1, 2, 3]
    assert all(g.group_size == 3 and g.policy_version == 0 for g in groups)
    assert adm.grant() == {}  # closed until a version is published
    assert [(e["event"], e["group"], e["version"]) for e in events(tmp_path, ledger)] == \
        [("admit", g, 0) for g in range(4)]


def test_a_restarted_workers_groups_go_first_then_a_resumed_runs_in_order(tmp_path):
    adm, ledger = admission(tmp_path, batch_size=4, readmit=[7, 5])
    adm.state.next_group = 10
    adm.state.running_prompts.update({7: 0, 5: 1})
    adm.joined(b"w0", AdmitRequest("rollout0", 2))
    assert [g.group_id for g in adm.grant()[b"w0"]] == [7, 5]  # resumed, in the order given
    adm.state.staleness.finish(7)  # 7 came back; 5 is still running on w0
    adm.routed(7, 0)
    adm.joined(b"w0", AdmitRequest("rollout0", 2))  # w0 restarted: 5 is generated again, still admitted
    assert adm.regenerate == [5] and adm.slots.free == {b"w0": 2} and adm.slots.owner == {}
    granted = adm.grant()[b"w0"]
    assert [g.group_id for g in granted] == [5, 10]  # again first, then a new prompt
    logged = [(e["group"], e.get("again"), e.get("resumed")) for e in events(tmp_path, ledger)]
    assert logged == [(7, None, True), (5, None, True), (5, "its rollout worker restarted", None), (10, None, None)]


def test_a_group_to_generate_again_that_came_back_meanwhile_is_skipped(tmp_path):
    adm, _ = admission(tmp_path)
    adm.joined(b"w0", AdmitRequest("rollout0", 1))
    adm.regenerate = [3]  # not running (its copy was scored first)
    granted = adm.grant()
    assert [g.group_id for g in granted[b"w0"]] == [0] and adm.regenerate == []


def test_judges_get_the_raw_fields_they_read_and_a_closing_run_admits_nothing(tmp_path):
    raw = [{"topic": f"raw{i}", "other": "x"} for i in range(len(ROWS))]
    adm, _ = admission(tmp_path, raw_rows=raw, judge_fields=["topic"])
    adm.joined(b"w0", AdmitRequest("rollout0", 1))
    (group,) = adm.grant()[b"w0"]
    assert group.raw == {"topic": f"raw{adm.state.running_prompts[group.group_id]}"}
    assert adm.routed(group.group_id, DROP) == {b"w0": [group.group_id]}  # a dropped group's copy may go
    assert group.group_id not in adm.state.running_prompts and adm.slots.free == {b"w0": 1}
    adm.closing = True
    assert adm.grant() == {}


def test_a_routed_groups_copy_is_kept_until_a_step_trains_it(tmp_path):
    adm, _ = admission(tmp_path)
    adm.joined(b"w0", AdmitRequest("rollout0", 2))
    (a, b) = adm.grant()[b"w0"]
    assert adm.routed(a.group_id, 1) == {} and adm.in_transit.again(a.group_id) == 1  # a copy goes to rank 1
    assert adm.routed(b.group_id, 0) == {}
    assert adm.in_transit.trained([a.group_id]) == {b"w0": [a.group_id]}
    assert adm.in_transit.again(a.group_id) == DROP  # trained: a copy is a duplicate
    assert adm.in_transit.all_held() == {b"w0": [b.group_id]} and adm.in_transit.routes == {}


def test_a_resumed_group_with_kept_trajectories_keeps_its_first_version_and_they_go_with_it(tmp_path):
    import asyncio

    from areal_flow.controller.kept import KeptTrajectories
    from areal_flow.transport.messages import KeptTrajectory

    kept = [KeptTrajectory(index=1, prompt_ids=[5], output_ids=[1, 2, 3], loss_mask=[1, 1, 0], logprobs=[-1, -1, 0],
                           versions=[2, 2, 2], answer_starts=[1], stepped=True, env_state={})]
    pending = KeptTrajectories(lambda *_: asyncio.sleep(0), {5: (2, kept)})
    adm, ledger = admission(tmp_path, batch_size=4, readmit=[7, 5], kept=pending)
    adm.state.staleness.set_version(3)
    adm.state.running_prompts.update({7: 0, 5: 1})
    adm.joined(b"w0", AdmitRequest("rollout0", 2))
    g7, g5 = adm.grant()[b"w0"]
    assert g7.kept == [] and g5.kept == kept
    # 5 is due by its first version + η, as if the run had never stopped; 7 starts over at 3.
    assert adm.state.staleness.running == {7: 3, 5: 2} and pending.pending == {}
    logged = [(e["group"], e["version"], e.get("kept_tokens")) for e in events(tmp_path, ledger)]
    assert logged == [(7, 3, None), (5, 2, 3)]


def test_a_checkpoint_collects_every_workers_trajectories_in_flight_and_waits_for_none_that_is_silent():
    import asyncio

    from areal_flow.controller.kept import KeptTrajectories
    from areal_flow.transport.messages import KeepLive, KeptTrajectory, Live

    one = KeptTrajectory(index=0, prompt_ids=[5], output_ids=[1], loss_mask=[1], logprobs=[-1], versions=[0],
                         answer_starts=[1], stepped=False, env_state={})

    async def main():
        sent = []

        async def send(ident, msg):
            sent.append((ident, msg))

        kept = KeptTrajectories(send, {9: (0, [one])})
        collecting = asyncio.ensure_future(kept.collect([b"w0", b"w1"], timeout=0.5))
        await asyncio.sleep(0.01)
        assert sent == [(b"w0", KeepLive(1)), (b"w1", KeepLive(1))]
        kept.reply(b"w0", Live(0, {3: [one]}))  # an answer to an earlier request: dropped
        kept.reply(b"w0", Live(1, {4: [one]}))
        kept.reply(b"w1", Live(1, {}))
        got = await collecting
        assert got == {4: [one], 9: [one]}  # and the groups a resumed run has yet to admit again
        t0 = asyncio.get_running_loop().time()
        got = await kept.collect([b"w0"], timeout=0.2)  # w0 says nothing: the checkpoint goes on
        assert got == {9: [one]} and asyncio.get_running_loop().time() - t0 < 1

    asyncio.run(main())
