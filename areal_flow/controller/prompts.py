"""The prompts the controller hands out: the datasets as it loads them, and the training prompts in a
seeded order, epoch after epoch (the cursor is part of the run state)."""

from __future__ import annotations

import random

from areal_flow.config.schema import RunConfig
from areal_flow.data.dataset import load_rows
from areal_flow.data.loading import load_prompts, prompt_room, row_format
from areal_flow.runtime.spec import RunSpec


def load_datasets(cfg: RunConfig, spec: RunSpec, graph, tokenizer) -> tuple[list[dict], list[dict], list[dict], list[str]]:
    """The training rows, the held-out rows, and the training rows as in the data (before the
    prompt templates, row by row as the first) with the fields the judges read, named last. The
    templates are applied here only: rollout workers and the held-out evaluation read the prompt
    field of these rows as it is. Prompts over the model's context were refused at launch, or are
    left out here as they were counted there."""
    ds, prompt_key = cfg.dataset, graph.dataset_input(graph.generate)
    room, skipped = prompt_room(cfg, spec.model_path), []
    train = load_prompts(ds, spec.train_path, ds.train_split, prompt_key, tokenizer, room, skipped)
    held_out = load_prompts(ds, spec.eval_path, ds.eval_split, prompt_key, tokenizer, room)
    judge_fields = sorted({k for j in graph.judges for k in graph.dataset_inputs(j)})
    places: list[str] = []
    raw = load_rows(spec.train_path, list(ds.fields), row_format(ds.name), ds.train_split, places) if judge_fields else []
    left_out = set(skipped)
    return train, held_out, [row for row, where in zip(raw, places) if where not in left_out], judge_fields


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
