"""The reward-hacking warning (controller/suspect_alarm.py): once, the first step past the threshold."""

from areal_flow.controller.suspect_alarm import SuspectAlarm


def test_it_warns_once_past_the_threshold_and_never_when_off():
    alarm = SuspectAlarm(0.05)
    assert alarm.observe({"step": 1, "reward/suspect": 0.05}) is None  # at the threshold: not past it
    assert alarm.observe({"step": 2}) is None  # a step without the figure (no code or math reward)
    message = alarm.observe({"step": 3, "reward/suspect": 0.125})
    assert message.startswith("reward hacking? 12.5% of step 3's samples were suspect")
    assert "metrics.suspect_warn=0.05" in message
    assert alarm.observe({"step": 4, "reward/suspect": 0.5}) is None  # said once
    assert SuspectAlarm(0.0).observe({"step": 1, "reward/suspect": 1.0}) is None
