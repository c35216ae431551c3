"""The paged backend: the engine's own forward (generation/engine/decode.py) over a paged KV cache
(generation/engine/paged.py, paged_batch.py), each step one forward that feeds the decoding rows their
newest token beside the next chunk of the prompts being prefilled.

Overlap schedule (`overlap`; SGLang's overlap scheduler): a step launches the sampling, then the
next forward, fed with the sampled tokens where they lie on the device, and only then waits for
the tokens on the host, to append them, answer the rows they end, and schedule the next step while
the device computes the forward. On a GPU the host's share of a step then hides behind the
device's; on the CPU the tokens and logprobs are the same either way. The price: a row whose last
token was just sampled goes through one more forward, whose result is dropped."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from areal_flow.generation.compute_counts import ComputeCounts
from areal_flow.generation.engine.cuda_graphs import GraphRunner
from areal_flow.generation.engine.decode import DecodeStep
from areal_flow.generation.engine.kv_batch import Row
from areal_flow.generation.engine.paged import BlockPool
from areal_flow.generation.engine.paged_batch import PagedBatch, Prefilled
from areal_flow.generation.engine.sampler import Drawn, Sampler
from areal_flow.generation.engine.sampling import RowSampling
from areal_flow.generation.engine.scheduler import BlockCapacity, Capacity
from areal_flow.generation.engine.step_timing import StepTimer
from areal_flow.generation.engine.stepper import Stepper


class PagedStepper(Stepper):
    """`requeue` queues rows retracted for want of blocks again, first in line (it takes the
    engine's lock); `chunk_tokens`: prompt tokens per forward (None: whole prompts)."""

    def __init__(self, pool: BlockPool, decode_step: DecodeStep, sampler: Sampler, counts: ComputeCounts, *,
                 chunk_tokens: int | None, graphs: GraphRunner | None, overlap: bool, timer: StepTimer | None,
                 requeue: Callable[[list[Row]], None]) -> None:
        self.pool, self.decode_step, self.sampler, self.counts = pool, decode_step, sampler, counts
        self.chunk_tokens, self.graphs, self.overlap, self.timer = chunk_tokens, graphs, overlap, timer
        self.requeue = requeue

    def capacity(self, batch: PagedBatch | None, live: list[Row], room: int, queued: int) -> Capacity:
        # How far the prefills of the sequences being prefilled have got: a row that wants prompt
        # logprobs from a position one has passed cannot follow it and prefills its own (PagedBatch.add).
        return BlockCapacity(
            free=self.pool.free_blocks - len(live), block_size=self.pool.block_size,
            prefilling={row.sequence for row in live if row.computed < len(row.sequence)},
            progress=batch.prefill_progress() if batch is not None else {})

    def step(self, batch: PagedBatch | None, admitted: list[Row], started: float) -> PagedBatch | None:
        """Sample a token for every ready row, then one forward: their new tokens and the next
        chunk of the rows being prefilled. Counts the step's time as decode and prefill, split by
        tokens. With `overlap`, rows are known to have finished one forward late: they go through
        it, and are dropped after (their extra keys and values freed with their blocks)."""
        if self.timer is not None:
            self.timer.begin(started)
        if batch is None:
            batch = PagedBatch(self.pool, self.decode_step, self.chunk_tokens, self.graphs, timer=self.timer)
        self.pool.ensure()
        batch.add(admitted)
        batch.drop_finished()
        sampled, kv, drawn = len(batch.ready), 0, None
        if sampled:
            if batch.sampling is None:
                batch.sampling = RowSampling.of([row.request.params for row in batch.ready], self.pool.device)
            drawn = self.sampler.launch(batch.ready, batch.logits, batch.sampling)
            kv = sum(row.computed + 1 for row in batch.ready)  # what their forward reads, as if all went on
            if not self.overlap:
                self.sampler.take(drawn)
                drawn = None
                batch.drop_finished()
        decode_tokens = prefill_tokens = 0
        if batch.rows:
            decode_tokens, prefill_tokens = self._forward(batch, drawn)
        elif drawn is not None:  # (with overlap every sampled row is in the forward: never here)
            self.sampler.take(drawn)
        self._count(batch, started, sampled, kv, decode_tokens, prefill_tokens)
        return batch if batch.rows else None

    def _forward(self, batch: PagedBatch, drawn: Drawn | None) -> tuple[int, int]:
        """The step's forward (after making room for it), with the sampled tokens `drawn` read back
        while it computes (overlap); returns its decode and prefill token counts."""
        retracted = batch.make_room()
        keep = {id(leader): _prompt_positions(leader, batch.followers.get(id(leader), ()))
                for leader in batch.pending}
        # Overlapped: the ready rows are the sampled ones (less those retracted, the last), in order.
        fed = None if drawn is None else drawn.tokens[: len(batch.ready)]
        decode_tokens, prefill_tokens, completed = batch.forward(keep, fed)
        if drawn is not None:  # the device computes the forward meanwhile
            self.sampler.take(drawn)  # (every sampled row is in the forward: never left out)
        if retracted:  # a retracted row whose last token ended it is answered, not queued
            self.requeue([row for row in retracted if row.finish is None])
        self._prefilled(batch, completed)
        for row in batch.ready:
            row.logits_version = self.sampler.version  # the forward computed its next logits
        if self.overlap:
            batch.drop_finished()  # the rows the tokens just read back ended
        return decode_tokens, prefill_tokens

    def _count(self, batch: PagedBatch, started: float, sampled: int, kv: int, decode_tokens: int,
               prefill_tokens: int) -> None:
        seconds = time.perf_counter() - started
        share = prefill_tokens / max(1, decode_tokens + prefill_tokens)
        if sampled:
            self.counts.decoded(sampled, kv, seconds * (1 - share))
        if prefill_tokens:
            self.counts.prefilled(prefill_tokens, prefill_tokens, seconds * share)
        self.counts.cached_tokens += batch.cached_tokens
        batch.cached_tokens = 0
        if self.timer is not None:
            self.timer.end(decode_only=bool(sampled) and not prefill_tokens)

    def _prefilled(self, batch: PagedBatch, completed: list[Prefilled]) -> None:
        """The prompt logprobs of the rows whose prefill the forward completed, for those that asked."""
        for prefilled in completed:
            rows = [prefilled.leader, *prefilled.followers]
            logits = prefilled.prompt_logits
            if logits is None and any(row.request.logprob_start_len is not None and not row.output_ids
                                      for row in rows):
                # Asked from the prompt's end: no position kept, and none reported, but a
                # prefill-only request (max_new_tokens 0) is answered there, not sampled.
                logits = batch.logits[:0]
            if logits is not None:
                self.sampler.prompt_logprobs(rows, logits[None].expand(len(rows), -1, -1))

    def discard(self, batch: PagedBatch | None) -> None:
        if batch is not None:
            batch.release_all()
        self.pool.reset()  # and whatever a failed step left taken

    def flush(self) -> None:
        self.pool.flush()

    def free_memory(self) -> None:
        self.pool.free_memory()

    def blocks(self) -> tuple[int, int, int]:
        pool = self.pool
        return pool.used_blocks, 0 if pool.growable else pool.num_blocks, pool.cached_blocks


def _prompt_positions(leader: Row, followers: Sequence[Row]) -> int:
    """How many of the last positions of a sequence the rows prefilling it need logits of: for
    prompt logprobs from logprob_start_len (0: none; the last one's come anyway). Only rows that
    joined before the prefill passed their first one follow it (paged_batch.can_follow)."""
    return max((row.prompt_positions for row in (leader, *followers)), default=0)
