"""The held-out evaluation as the step loop runs it: at the start or end with training time paused,
beside training pinned to a version, one at a time (controller/evaluator.py). The measuring itself
(evaluation.py) is replaced by a stand-in that records its calls."""

import asyncio
import json
from types import SimpleNamespace

import pytest

from areal_flow.controller.evaluator import Evaluator
from areal_flow.controller.run_metrics import RunClock
from areal_flow.controller.watchdog import Progress, Wait
from areal_flow.metrics.writer import MetricsWriter


def evaluator(tmp_path, every_versions=2, colocated=False):
    cfg = SimpleNamespace(eval=SimpleNamespace(every_versions=every_versions))
    graph = SimpleNamespace(eval_reward=SimpleNamespace(name="math", fn="math"), generate="gen",
                            dataset_input=lambda node: "prompt", reference=lambda reward: "answer", colocated=colocated)
    woken = []
    clock = RunClock()
    clock.start()
    ev = Evaluator(cfg, graph, None, None, [], None, run_dir=str(tmp_path), metrics=MetricsWriter(str(tmp_path / "m.jsonl")),
                   clock=clock, progress=Progress(), wake=lambda: woken.append(True))
    return ev, woken


def rows(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]


def test_an_evaluation_beside_training_holds_the_next_load_and_one_due_meanwhile_is_skipped(tmp_path):
    ev, woken = evaluator(tmp_path)
    order = []

    async def scenario():
        release = asyncio.Event()

        async def held_out(when, version, steps_before):
            order.append(f"eval {when} from step {steps_before}")
            await release.wait()
            order.append("eval done")
            return 0.5

        ev.held_out = held_out
        ev.step_trained()
        assert await ev.beside(2) is False  # runs on: the trainer does not wait for it
        await asyncio.sleep(0)
        assert await ev.beside(4) is False  # skipped: the one at version 2 still runs

        async def load():
            await ev.before_load(3)
            order.append("load v3")

        loading = asyncio.create_task(load())
        await asyncio.sleep(0.05)
        assert ev.progress.waiting == Wait.PINNED_LOAD.of(pinned=2, version=3) and not loading.done()
        release.set()
        await loading
        await asyncio.sleep(0)  # the evaluation's done callback

    asyncio.run(asyncio.wait_for(scenario(), 10))
    assert order == ["eval version 2 from step 1", "eval done", "load v3"]
    assert woken == [True] and not ev.pin.held
    assert [(r["event"], r["version"], r["running"]) for r in rows(tmp_path)] == [("eval_skipped", 4, 2)]


def test_a_failed_evaluation_beside_training_raises_in_the_step_loop(tmp_path):
    ev, woken = evaluator(tmp_path)

    async def scenario():
        async def held_out(when, version, steps_before):
            raise RuntimeError("reward workers died")

        ev.held_out = held_out
        await ev.beside(2)
        ev.check()  # still running: nothing to raise yet
        await asyncio.sleep(0.01)
        ev.check()

    with pytest.raises(RuntimeError, match="reward workers died"):
        asyncio.run(scenario())
    assert woken == [True] and not ev.pin.held


def test_colocated_the_evaluation_runs_to_its_end_in_generations_turn(tmp_path):
    ev, _ = evaluator(tmp_path, colocated=True)
    done = []

    async def scenario():
        async def held_out(when, version, steps_before):
            await asyncio.sleep(0.01)
            done.append(version)

        ev.held_out = held_out
        return await ev.beside(2)

    assert asyncio.run(scenario()) is True and done == [2]


def test_the_start_and_end_evaluations_pause_training_time_and_say_what_they_wait_for(tmp_path):
    ev, _ = evaluator(tmp_path)

    async def scenario():
        async def held_out(when, version, steps_before):
            assert str(ev.progress.waiting) == "the held-out evaluation at start"
            await asyncio.sleep(0.05)
            return 0.25

        ev.held_out = held_out
        return await ev.at("start", 0)

    assert asyncio.run(scenario()) == 0.25
    assert ev.clock.paused_seconds >= 0.05


def test_an_evaluation_is_due_every_eval_every_versions_versions(tmp_path):
    assert [v for v in range(1, 9) if evaluator(tmp_path, every_versions=3)[0].due(v)] == [3, 6]
    assert not any(evaluator(tmp_path, every_versions=0)[0].due(v) for v in range(1, 9))
