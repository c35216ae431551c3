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

    def seek(self, epoch: int, cursor: int) -> None:
        """Continue from a saved position: the next row is the one after `cursor` rows of pass `epoch`."""
        self.epoch, self.cursor = epoch, cursor
        self._order = self._shuffled(epoch)

    def next_index(self) -> int:
        """The index in `rows` of the next prompt (a group's prompt, which a resumed run finds by it)."""
        if self.cursor == len(self._order):
            self.epoch, self.cursor = self.epoch + 1, 0
            self._order = self._shuffled(self.epoch)
        self.cursor += 1
        return self._order[self.cursor - 1]

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next(self) -> dict[str, str]:
        return self.rows[self.next_index()]
