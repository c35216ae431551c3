"""The staleness warning (controller/weight_alarm.py): once, after enough steps in a row in trouble,
naming η, the stalest tokens and what to change."""

from areal_flow.controller.weight_alarm import WeightAlarm


def row(capped: float | None = 0.0, ess: float | None = 1.0, **more) -> dict:
    return {"train/capped_fraction": capped, "train/ess_fraction": ess, **more}


def test_it_warns_once_after_the_set_steps_in_a_row():
    alarm = WeightAlarm(capped_fraction=0.05, ess_fraction=0.5, steps=3, eta=8)
    stale = {"train/stale/0/tokens": 10.0, "train/stale/9+/tokens": 4.0, "train/stale/5-8/tokens": 3.0,
             "train/stale/9+/weight_mean": 3.25}
    # Two bad steps, a good one (the count starts again), then three bad ones: one warning.
    said = [alarm.observe(r) for r in (row(0.2), row(0.2), row(0.01), row(0.2, **stale), row(ess=0.3),
                                       row(0.3, **stale), row(0.3), row(0.3))]
    assert [m is not None for m in said] == [False] * 5 + [True, False, False]
    message = said[5]
    assert message.startswith("staleness: 30.0% of the tokens had a behaviour weight")  # the step that raised it
    assert "(3 steps in a row); the stalest tokens" in message
    assert "rollout.max_staleness=8" in message and "algorithm.lr" in message
    assert "the stalest tokens (9+ versions behind) had a mean weight of 3.25" in message
    assert alarm.in_a_row == 5


def test_a_low_effective_sample_size_alone_is_trouble_and_zero_turns_either_off():
    alarm = WeightAlarm(capped_fraction=0.05, ess_fraction=0.5, steps=1, eta=2)
    assert "effective sample size was 30%" in alarm.observe(row(ess=0.3))
    off = WeightAlarm(capped_fraction=0.0, ess_fraction=0.0, steps=1, eta=2)
    assert off.observe(row(0.9, 0.01)) is None and off.in_a_row == 0
    # A naive PPO run (no π_prox) has neither figure: never in trouble.
    assert WeightAlarm(0.05, 0.5, 1, 4).observe({"train/loss": 1.0}) is None
