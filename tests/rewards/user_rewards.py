"""Reward functions of a user's own module, named in configs as `user_rewards:<function>`."""

import asyncio
import os
import time


def exact(completion: str, reference: str) -> float:
    return float(completion.strip() == reference.strip())


def with_stats(completion: str, reference: str) -> dict:
    return {"reward": float(reference in completion), "length": len(completion)}


def sleeps(completion: str, reference: str) -> float:
    time.sleep(float(reference))
    return 1.0


def spins(completion: str, reference: str) -> float:
    while True:  # pure Python: only killing the worker stops it
        pass


def dies(completion: str, reference: str) -> float:
    os._exit(3)


def raises(completion: str, reference: str) -> float:
    raise ZeroDivisionError("the user's bug")


def returns_text(completion: str, reference: str) -> str:
    return "1.0"


async def async_exact(completion: str, reference: str) -> float:
    await asyncio.sleep(0.01)
    return float(completion == reference)


async def async_hangs(completion: str, reference: str) -> float:
    await asyncio.sleep(3600)
    return 1.0


NOT_CALLABLE = 3
