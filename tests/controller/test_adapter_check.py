"""The per-answer proof of arrival (controller/adapter_check.py): each sample's servers' accounts
against the trainer's digest of each version."""

import pytest

from areal_flow.controller.adapter_check import AdapterCheck, AdapterMismatch
from areal_flow.transport.messages import Finish, GroupMeta, SampleMeta, Served


def group(*served: list[Served]) -> GroupMeta:
    return GroupMeta(4, "reward0", [SampleMeta(f"g4-{i}", i, {}, {}, {}, Finish.STOP, list(s))
                                    for i, s in enumerate(served)])


def test_accounts_that_match_or_are_of_versions_not_trained_here_pass():
    check = AdapterCheck()
    check.trained(1, "aa")
    check.trained(2, "")  # no LoRA: nothing to check
    assert check.check(group([Served("gen_server0", 1, "aa")], [Served("gen_server1", 0, ""), Served("s", 2, "")],
                             [Served("gen_server0", 7, "zz")])) is None  # 0: the base; 7: not trained here
    check.raise_if_mismatched()


@pytest.mark.parametrize("reported, said", [("bb", "with adapters of digest bb"), ("", "with no adapters")])
def test_a_server_reporting_other_adapters_or_none_is_named_with_the_version_and_stops_the_run(reported, said):
    check = AdapterCheck()
    check.trained(3, "aa")
    problem = check.check(group([Served("gen_server0", 3, "aa")],
                                [Served("gen_server0", 2, "q"), Served("gen_server1", 3, reported)]))
    assert problem is not None
    for part in ("generation server gen_server1", "sample g4-1", "weight version 3", said, "have digest aa"):
        assert part in problem
    with pytest.raises(AdapterMismatch, match="gen_server1"):
        check.raise_if_mismatched()
    check.check(group([Served("gen_server2", 3, "cc")]))
    assert "gen_server1" in check.problem  # the first one found is what the run stops with


def test_a_run_whose_servers_get_merged_weights_checks_nothing():
    """generation.backend=sglang: the trainer's weight channels send SGLang merged weights, whose
    answers report no adapters."""
    check = AdapterCheck(active=False)
    check.trained(1, "aa")
    assert check.check(group([Served("gen_server0", 1, "")])) is None
