"""The dense backend: the transformers forward over a left-padded KV cache that grows in place
(kv_batch.Batch), for every architecture the engine serves, also those generation/engine/decode.py does
not take. Admitted requests are prefilled in one forward and joined to the running batch with
one copy of its cache; finished rows stay in the batch as dead rows until enough of them are
(or new rows join) that compacting pays for its copy."""

from __future__ import annotations

import time

import torch
from transformers.cache_utils import Cache

from areal_flow.generation.compute_counts import ComputeCounts
from areal_flow.generation.engine.kv_batch import Batch, GrowingLayer, Row
from areal_flow.generation.engine.sampler import Sampler
from areal_flow.generation.engine.scheduler import Capacity, TokenCapacity
from areal_flow.generation.engine.stepper import Stepper

COMPACT_AT = 0.75
"""Compact the batch once a quarter of its rows are dead (measured best of 1/2, 3/4, 9/10 on
tools/bench_generation.py): a dead row costs a full row of every decode step until then."""


class DenseStepper(Stepper):
    def __init__(self, model: torch.nn.Module, device: torch.device, sampler: Sampler, counts: ComputeCounts,
                 max_batch_size: int, max_total_tokens: int | None) -> None:
        self.model, self.device, self.sampler, self.counts = model, device, sampler, counts
        self.max_total_tokens = max_total_tokens
        # New requests join in groups: each join costs a prefill forward and a copy of the
        # left-padded cache, so only a short queue may join one request at a time.
        self.join_group = max(1, max_batch_size // 8)

    def capacity(self, batch: Batch | None, live: list[Row], room: int, queued: int) -> Capacity | None:
        if batch is not None and room < min(self.join_group, queued):
            return None
        return TokenCapacity.of(self.max_total_tokens, live)

    def step(self, batch: Batch | None, admitted: list[Row], started: float) -> Batch | None:
        if admitted:
            batch = self._join(batch, admitted, started)
        elif len(batch.live()) <= COMPACT_AT * len(batch.rows):
            batch = Batch.combine([(batch, batch.live())])  # enough rows dead: compact
        # A compaction's copy counts with the decode step it comes before.
        decoding = time.perf_counter() if admitted else started
        rows, width = len(batch.live()), batch.mask.shape[1] + 1  # the forward adds a column
        batch = self._decode(batch)
        self.counts.decoded(rows, rows * width, time.perf_counter() - decoding)
        return batch

    def _join(self, batch: Batch | None, admitted: list[Row], started: float) -> Batch:
        """Prefill the admitted rows and add them to the running batch; the copy that joins them
        counts with the prefill."""
        part = self._prefill(admitted)
        joined = part if batch is None else Batch.combine(
            [(batch, batch.live()), (part, list(range(len(part.rows))))])
        lengths = [len(q) for q in {row.sequence for row in admitted}]
        self.counts.prefilled(sum(lengths), len(lengths) * max(lengths), time.perf_counter() - started)
        return joined

    def _prefill(self, rows: list[Row]) -> Batch:
        """One forward over the rows' prompts (a retracted row: prompt + tokens so far). Identical
        sequences are computed once and their cache rows copied."""
        sequences: dict[tuple[int, ...], int] = {}
        index = [sequences.setdefault(row.sequence, len(sequences)) for row in rows]
        for row in rows:
            row.logits_version = self.sampler.version
        width = max(map(len, sequences))
        ids = torch.zeros(len(sequences), width, dtype=torch.int64)  # pad id 0: masked out, never attended
        mask = torch.zeros(len(sequences), width, dtype=torch.int64)
        for i, sequence in enumerate(sequences):
            ids[i, width - len(sequence):] = torch.tensor(sequence)
            mask[i, width - len(sequence):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)  # built on the host: one copy each
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        # Prompt logits only for rows that asked for prompt logprobs, and only from their start. (A
        # retracted row has them already.)
        scored = [r for r in rows if r.request.logprob_start_len is not None and not r.output_ids]
        keep = max([1] + [len(r.request.input_ids) - r.request.logprob_start_len for r in scored])
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                         past_key_values=Cache(layer_class_to_replicate=GrowingLayer), use_cache=True,
                         logits_to_keep=keep)
        cache, logits = out.past_key_values, out.logits
        if len(sequences) < len(rows):
            rows_of = torch.tensor(index, device=self.device)
            cache = Cache(layers=[GrowingLayer.gather([(layer.keys, layer.values, rows_of, 0)], width)
                                  for layer in cache.layers])
            mask, logits = mask[rows_of], logits[rows_of]
        if scored:
            self.sampler.prompt_logprobs(rows, logits)
        return Batch(rows, cache, mask, logits[:, -1].float())

    def _decode(self, batch: Batch) -> Batch | None:
        """Sample a token for every live row, set aside the rows that finish, decode one step."""
        alive, tokens = self.sampler.sample(batch.rows, batch.logits, batch.sampling)
        if alive == 0:
            return None
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones(len(batch.rows), 1)], dim=1)
        # A dead row's position stops advancing, so it never runs past the context length.
        positions = torch.tensor([row.last_position for row in batch.rows], device=self.device)
        out = self.model(
            input_ids=tokens[:, None], attention_mask=batch.mask, position_ids=positions[:, None],
            past_key_values=batch.cache, use_cache=True,
        )
        batch.logits = out.logits[:, -1].float()
        return batch
