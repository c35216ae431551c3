"""A run whose rollouts fail stops with one line (controller/rollout_failures.py): failed groups in
a row, none scored between them (an agent that fails every rollout), and an environment's errors
past their share of the last trajectories; each error counted in the step rows."""

from types import SimpleNamespace

from areal_flow.controller.rollout_failures import ERROR_WINDOW, RolloutFailures
from areal_flow.transport.messages import Finish, GroupMeta, SampleMeta

AGENT_FAILED = ("rollout g7-0 failed 1 run(s) (graph.generate.agent_retries=0): agent my_pkg.agent:run: ValueError: "
                "returned None, not a reward (a number, or a list of per-turn numbers): does it end without a "
                "`return`?")


def group(gid: int, errors: int = 0, size: int = 4) -> GroupMeta:
    """A scored group of `size` trajectories, the first `errors` of which ended in their environment's error."""
    return GroupMeta(gid, "reward0", [SampleMeta(f"g{gid}-{i}", i, {"output_ids": 3}, {0: 3},
                                                 {"rewards": 0.0, **({"env/error": 1.0} if i < errors else {})},
                                                 Finish.STOP) for i in range(size)])


def failures(stall: int = 5, env: str | None = None, share: float = 0.5) -> RolloutFailures:
    node = SimpleNamespace(name="generate", env=env, env_error_share=share)
    return RolloutFailures.of(stall, node)


def test_failed_groups_in_a_row_stop_the_run_naming_the_last_failure_and_the_key():
    watch = failures(stall=5)
    for gid in range(4):
        watch.observe(GroupMeta(gid, "reward0", []), AGENT_FAILED)
    assert watch.stopped() is None
    watch.observe(group(4), None)  # a group that generated (kept or filtered): the rollouts work
    for gid in range(5, 9):
        watch.observe(GroupMeta(gid, "reward0", []), AGENT_FAILED)
    assert watch.stopped() is None
    watch.observe(GroupMeta(9, "reward0", []), AGENT_FAILED)
    assert watch.stopped() == ("the run trains nothing: the last 5 prompt groups failed in a row, none scored between "
                               f"them (rollout.failed_groups_stall=5); the last: {AGENT_FAILED}")
    assert watch.step_figures() == {}  # no environment: no env/errors


def test_a_stall_of_0_never_stops():
    watch = failures(stall=0)
    for gid in range(1000):
        watch.observe(GroupMeta(gid, "reward0", []), AGENT_FAILED)
    assert watch.stopped() is None


def test_environment_errors_are_counted_per_step_and_the_run_goes_on_below_their_share():
    """An environment that raises in 1 trajectory of 8 (a step() that fails now and then): every
    error counted in its step's row, the run never stopped."""
    watch = failures(env="my_envs:Flaky", stall=0)
    problem = "environment my_envs:Flaky raised in 1 of 4 trajectories: step() raised at flaky.py:9 in step: RuntimeError"
    for gid in range(1000):
        watch.observe(group(gid, errors=gid % 2), problem if gid % 2 else None)
        assert watch.stopped() is None
        if gid == 9:
            assert watch.step_figures() == {"env/errors": 5, "env/error_share": 5 / 40}
    assert watch.step_figures() == {"env/errors": 495, "env/error_share": 495 / 3960}
    assert watch.step_figures() == {"env/errors": 0, "env/error_share": 0.0}  # nothing since the last row


def test_environment_errors_past_their_share_of_the_last_trajectories_stop_the_run_naming_it_and_the_key():
    watch = failures(env="my_envs:Broken", share=0.5, stall=0)
    for gid in range(100):  # half the trajectories raised: not past the share
        watch.observe(group(gid, errors=2), "environment my_envs:Broken raised in 2 of 4 trajectories: ...")
    assert watch.stopped() is None
    last = "environment my_envs:Broken raised in 3 of 4 trajectories: step() raised at broken.py:3 in step: KeyError: 'x'"
    watch.observe(group(100, errors=3), last)
    assert watch.stopped() == (f"environment my_envs:Broken raised in 101 of the last {ERROR_WINDOW} trajectories, more "
                               f"than graph.generate.env_error_share=0.5 of {ERROR_WINDOW}; the last: {last}")


def test_an_environment_that_always_raises_stops_the_run_before_the_window_fills():
    watch = failures(env="my_envs:Broken", share=0.25, stall=0)
    for gid in range(13):  # 52 trajectories, every one an error: past 0.25 of 200 at the 51st
        assert watch.stopped() is None
        watch.observe(group(gid, errors=4), "environment my_envs:Broken raised in 4 of 4 trajectories: ...")
    assert watch.stopped().startswith("environment my_envs:Broken raised in 52 of the last 52 trajectories")


def test_a_share_of_1_never_stops():
    watch = failures(env="my_envs:Broken", share=1.0, stall=0)
    for gid in range(500):
        watch.observe(group(gid, errors=4), "environment my_envs:Broken raised in 4 of 4 trajectories: ...")
    assert watch.stopped() is None
