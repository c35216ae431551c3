"""What the step loop waits for (a typed value, shown as the same sentence as ever) and the watchdog
that fails a run when no step completes in step_timeout (controller/watchdog.py)."""

import asyncio

import pytest

from areal_flow.controller.watchdog import Progress, StalledRun, Wait, until_stalled

# Each wait as a stalled run's error has always written it (controller/main.py's waiting_for strings).
SENTENCES = [
    (Wait.START_UP.of(), "start-up"),
    (Wait.EVALUATION.of(when="start"), "the held-out evaluation at start"),
    (Wait.EVALUATION.of(when="version 4"), "the held-out evaluation at version 4"),
    (Wait.PINNED_LOAD.of(pinned=4, version=6), "the held-out evaluation at version 4 before loading version 6"),
    (Wait.CHECKPOINT.of(step=3), "the trainer ranks to save the checkpoint of step 3"),
    (Wait.SERVER_COUNTS.of(), "the generation servers' counts of the step (/get_server_info)"),
    (Wait.LOAD.of(version=5), "the generation servers to load the weights of version 5"),
    (Wait.BATCH.of(step=7), "finished prompt groups to train step 7"),
    (Wait.MEMORY.of(step=7), "the generation servers to free their memory for step 7"),
    (Wait.STEP.of(step=7), "the trainer ranks to finish step 7"),
    (Wait.SEND_WEIGHTS.of(version=8), "the trainer ranks to send weight version 8"),
    (Wait.RANKS.of(missing="trainer1, trainer3", what="step 7"), "trainer1, trainer3 to finish step 7"),
    (Wait.NEW_RANKS.of(n=4, path="/r/checkpoints/step-00000007"),
     "4 new trainer rank(s) to start from the checkpoint /r/checkpoints/step-00000007 (a trainer resize)"),
]


@pytest.mark.parametrize("waiting, sentence", SENTENCES, ids=[w.on.name for w, _ in SENTENCES])
def test_each_wait_reads_as_the_sentence_users_have_always_seen(waiting, sentence):
    assert str(waiting) == sentence


def test_every_kind_of_wait_is_pinned_above():
    assert {w.on for w, _ in SENTENCES} == set(Wait)


def test_a_wait_takes_exactly_the_fields_its_sentence_names():
    with pytest.raises(TypeError, match=r"Wait.STEP names \['step'\], given \['version'\]"):
        Wait.STEP.of(version=3)
    with pytest.raises(TypeError):
        Wait.SERVER_COUNTS.of(step=1)
    assert Wait.BATCH.of(step=2).on is Wait.BATCH and Wait.BATCH.of(step=2) == Wait.BATCH.of(step=2)


def test_a_loop_that_ends_returns_its_result_and_one_that_makes_progress_is_not_stopped():
    async def scenario():
        progress = Progress()

        async def loop():
            for _ in range(8):  # 0.4 s in all, progress every 0.05 s: longer than the timeout, never idle that long
                await asyncio.sleep(0.05)
                progress.made()
            return 42

        async def nothing() -> str:
            return ""

        return await until_stalled(loop(), progress, 0.25, nothing)

    assert asyncio.run(scenario()) == 42


def test_no_progress_within_step_timeout_fails_the_run_naming_the_wait_and_the_situation():
    async def scenario():
        progress = Progress()
        progress.waits(Wait.BATCH, step=3)

        async def situation() -> str:
            return "; 2 prompt group(s) finished, 5 generating"

        await until_stalled(asyncio.sleep(30), progress, 0.2, situation)

    with pytest.raises(StalledRun) as e:
        asyncio.run(asyncio.wait_for(scenario(), 10))
    assert str(e.value) == ("no train step completed within 0 s (step_timeout); the controller waits for finished "
                            "prompt groups to train step 3; 2 prompt group(s) finished, 5 generating")


def test_a_step_timeout_of_zero_runs_without_a_watchdog():
    async def scenario():
        async def loop():
            await asyncio.sleep(0.1)
            return "done"

        async def never() -> str:
            raise AssertionError("no watchdog, no situation")

        return await until_stalled(loop(), Progress(), 0, never)

    assert asyncio.run(scenario()) == "done"
