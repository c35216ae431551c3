import pytest

from areal_flow.controller.slots import RolloutSlots


def test_groups_spread_over_workers_and_a_slot_comes_back_when_its_group_is_scored():
    slots = RolloutSlots()
    slots.offer(b"rollout0", 2)
    slots.offer(b"rollout1", 2)
    assert [slots.take(g) for g in range(4)] == [b"rollout0", b"rollout1", b"rollout0", b"rollout1"]
    assert not slots  # every slot is taken: nothing more is admitted
    with pytest.raises(RuntimeError, match="no rollout worker has a free slot"):
        slots.take(4)
    slots.release(3)  # rollout1's group is scored (or dropped)
    assert slots and slots.take(4) == b"rollout1"
    assert slots.owner == {0: b"rollout0", 1: b"rollout1", 2: b"rollout0", 4: b"rollout1"}


def test_a_worker_that_offers_later_gets_the_next_groups_until_it_has_caught_up():
    slots = RolloutSlots()
    slots.offer(b"rollout0", 3)
    slots.take(0)
    slots.offer(b"rollout1", 3)  # started late
    assert [slots.take(g) for g in range(1, 4)] == [b"rollout1", b"rollout0", b"rollout1"]


def test_no_worker_no_slot():
    slots = RolloutSlots()
    assert not slots
    with pytest.raises(RuntimeError):
        slots.take(0)


def test_bad_offers_and_double_takes_are_refused():
    slots = RolloutSlots()
    with pytest.raises(ValueError, match="rollout0 offered 0 slots"):
        slots.offer(b"rollout0", 0)
    slots.offer(b"rollout0", 2)
    slots.take(7)
    with pytest.raises(ValueError, match="group 7 was given a slot twice"):
        slots.take(7)
    with pytest.raises(KeyError):
        slots.release(8)  # never admitted: a bug in the caller, not a slot to hand out
