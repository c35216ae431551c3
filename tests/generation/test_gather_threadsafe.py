"""The server's wait for a request's answers: the engine's futures, finished on other threads,
gathered into one future of the event loop that wakes it once."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future

import pytest

from areal_flow.generation.engine.generation_engine import EngineShutdownError
from areal_flow.generation.http.routes import gather_threadsafe


def finish_later(futures: list[Future], outcomes: list, delay: float = 0.01) -> threading.Thread:
    """Set each future's outcome (a value, or an exception to raise) from another thread, the last first."""
    def run() -> None:
        for future, outcome in reversed(list(zip(futures, outcomes))):
            time.sleep(delay)
            if isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_the_results_come_in_request_order_once_the_last_is_done_with_one_wake_up():
    async def main() -> tuple[list, int]:
        loop = asyncio.get_running_loop()
        wakes = 0
        original = loop.call_soon_threadsafe

        def counting(*args, **kwargs):
            nonlocal wakes
            wakes += 1
            return original(*args, **kwargs)

        loop.call_soon_threadsafe = counting  # what a thread does to wake the loop
        futures = [Future() for _ in range(8)]
        futures[3].set_result("already")  # done before the gather: counted at once
        thread = finish_later(futures[:3] + futures[4:], [f"answer {i}" for i in range(8) if i != 3])
        gathered = gather_threadsafe(futures, loop)
        assert not gathered.done()
        results = await asyncio.wait_for(gathered, 10)
        thread.join()
        return results, wakes

    results, wakes = asyncio.run(main())
    assert results == [f"answer {i}" if i != 3 else "already" for i in range(8)]
    assert wakes == 1


def test_a_failed_answer_fails_the_request_with_its_error_and_no_answers_at_all_is_empty():
    async def main() -> None:
        loop = asyncio.get_running_loop()
        futures = [Future() for _ in range(3)]
        thread = finish_later(futures, ["a", EngineShutdownError("the generation engine shut down"), "c"])
        with pytest.raises(EngineShutdownError, match="shut down"):
            await asyncio.wait_for(gather_threadsafe(futures, loop), 10)
        thread.join()
        assert await gather_threadsafe([], loop) == []

    asyncio.run(main())
