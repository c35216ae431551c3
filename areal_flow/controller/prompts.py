"""The training prompts in a seeded order, epoch after epoch; the cursor is part of the run state."""

from __future__ import annotations

import random


class PromptStream:
    def __init__(self, rows: list[dict[str, str]], seed: int):
        if not rows:
            raise ValueError("the training dataset is empty")
        self.rows, self.seed = rows, seed
        self.epoch, self.cursor = 0, 0
        self._order = self._shuffled(0)

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next(self) -> dict[str, str]:
        if self.cursor == len(self._order):
            self.epoch, self.cursor = self.epoch + 1, 0
            self._order = self._shuffled(self.epoch)
        row = self.rows[self._order[self.cursor]]
        self.cursor += 1
        return row
