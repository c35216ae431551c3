"""The running rows over the paged KV cache, and the plan of each forward.

A row is either **ready** (its logits say what it samples next) or **pending** (its sequence is
being prefilled, a chunk per forward); a pending row may lead **followers**, rows of the same
sequence (the G answers of a prompt) that wait for its prefill and then fork its blocks: one
prefill per prompt (a row that arrives once the prefill has passed the prompt positions it wants
logprobs of leads another: `add`). A row whose sequence only begins like a pending row's (the answers of
a prompt cut by a weight update, resubmitted with their tokens so far) **waits** for that prefill to
pass their shared full blocks, then takes them from the prefix cache instead of computing them again:
a leader's full blocks enter the cache as soon as they are computed (SGLang caches unfinished
requests alike). A forward feeds every ready row its newest token and the pending rows up to
`chunk_tokens` tokens of prompt, in order (SGLang's chunked prefill, mixed with the decode rows).

Blocks are taken before each forward; when the pool has too few, the newest rows are retracted
(`make_room` returns them, blocks freed, to be queued again with their tokens so far and
prefilled anew): the oldest row always goes on. The engine samples and answers; this module
only keeps the cache and runs the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from areal_flow.generation.engine.cuda_graphs import GraphRunner
from areal_flow.generation.engine.decode import DecodeStep, Forward
from areal_flow.generation.engine.kv_batch import Row
from areal_flow.generation.engine.paged import BlockPool
from areal_flow.generation.engine.paged_inputs import PrefillInputs, common_blocks, spans, upload
from areal_flow.generation.engine.sampling import RowSampling
from areal_flow.generation.engine.step_timing import StepTimer
from areal_flow.runtime.devices import to_device


@dataclass
class Prefilled:
    """A row whose prefill a forward completed, with the rows that forked it."""

    leader: Row
    followers: list[Row]
    prompt_logits: torch.Tensor | None  # [keep, V]: the last `keep` positions' logits, if a row asked


@dataclass
class PagedBatch:
    pool: BlockPool
    model: DecodeStep
    chunk_tokens: int | None = None  # prompt tokens per forward; None: whole sequences
    runner: GraphRunner | None = None  # replays decode steps as CUDA graphs; None: eager
    ready: list[Row] = field(default_factory=list)
    logits: torch.Tensor | None = None  # [len(ready), V] float32
    pending: list[Row] = field(default_factory=list)
    followers: dict[int, list[Row]] = field(default_factory=dict)  # id(leader) -> rows waiting for it
    # id(leader) -> rows sharing its first full blocks, not yet taking them (`add`, `_release_waiting`)
    waiting: dict[int, list[Row]] = field(default_factory=dict)
    sampling: RowSampling | None = None  # the ready rows' settings, kept while they stay the same rows
    timer: StepTimer | None = None  # times the model's forward call (the engine's time_steps)
    cached_tokens: int = 0  # prompt tokens whose prefill the prefix cache spared (paged_stepper.py moves them to the counts)
    _prompt_logits: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    # The block tables of ready[:len(_table)] on the host, padded with the null block 0 and with
    # spare columns: kept across steps (a decode step writes only the rows that took a block) so
    # that building the step's table costs no Python loop over every row's every block. Follows
    # `ready`: rows dropped or retracted are dropped from it, rows appended are built on the next
    # forward; None: built anew.
    _table: np.ndarray | None = None

    @property
    def rows(self) -> list[Row]:
        return [*self.ready, *self.pending, *(row for rows in self.followers.values() for row in rows),
                *(row for rows in self.waiting.values() for row in rows)]

    def live(self) -> list[int]:
        return [i for i, row in enumerate(self.rows) if row.finish is None]

    def live_rows(self) -> list[Row]:
        return [row for row in self.rows if row.finish is None]

    def add(self, rows: list[Row]) -> None:
        """Rows to prefill: the first of each sequence leads, the others follow it. A row follows
        only a leader whose prefill has not yet passed the first position it needs prompt logits
        of (`can_follow`); past it, those logits are gone (a forward keeps only the positions its
        rows ask for then), so the row leads a prefill of its own."""
        leaders = [(row.sequence, row) for row in self.pending if row.finish is None]
        for row in rows:
            row.blocks, row.computed = [], 0
            sequence = row.sequence
            # The newest such leader (as ever, when there was only one per sequence).
            leader = next((lead for s, lead in reversed(leaders)
                           if s == sequence and can_follow(lead.computed, row)), None)
            if leader is None:
                ahead = self._shared_prefill(row)
                if ahead is not None:
                    self.waiting.setdefault(id(ahead), []).append(row)
                    continue
                leaders.append((sequence, row))
                self.pending.append(row)
                self._reuse(row)
            else:
                row.epoch = leader.epoch
                self.followers.setdefault(id(leader), []).append(row)

    def _shared_prefill(self, row: Row) -> Row | None:
        """The pending leader whose prefill will compute full blocks `row` could take from the
        prefix cache (the most such blocks), or None (also for a row that wants prompt logprobs).
        A leader that has computed them already puts them in the cache now, and the row takes them
        at once (None)."""
        if not self.pool.prefix_cache or row.prompt_positions:
            # A row asking for prompt logprobs keeps to following or leading a prefill of its own:
            # a prefix taken from the cache would leave a later row of its sequence nothing to follow.
            return None
        best, shared = None, 0
        for lead in self.pending:
            if lead.finish is None and lead.epoch == self.pool.epoch and (tokens := self._shared(row, lead)) > shared:
                best, shared = lead, tokens
        if best is None or best.computed >= shared:
            if best is not None:
                self._register(best)
            return None
        return best

    def _shared(self, row: Row, lead: Row) -> int:
        """The tokens of the first full blocks `row` shares with `lead` and may take from the cache:
        none of the positions whose logits its prompt logprobs need, nor its last token."""
        size = self.pool.block_size
        return size * common_blocks(row.sequence, lead.sequence, size,
                                     (len(row.sequence) - max(1, row.prompt_positions)) // size)

    def _register(self, row: Row) -> None:
        """Put a row's computed full blocks in the prefix cache while it runs (they never change)."""
        self.pool.register(row.blocks, row.sequence[: row.computed], row.epoch)

    def _release_waiting(self) -> None:
        """The waiting rows whose leader has computed their shared blocks (registered now), or no
        longer prefills, go on as rows added anew: they take those blocks from the cache."""
        pending = {id(row): row for row in self.pending if row.finish is None}
        released = []
        for key, rows in list(self.waiting.items()):
            lead = pending.get(key)
            go = {id(row) for row in rows if lead is None or lead.computed >= self._shared(row, lead)}
            if go and lead is not None:
                self._register(lead)
            released += [row for row in rows if id(row) in go]
            if stay := [row for row in rows if id(row) not in go]:
                self.waiting[key] = stay
            else:
                del self.waiting[key]
        self.add([row for row in released if row.finish is None])

    def _reuse(self, row: Row) -> None:
        """Start a leader's prefill past the blocks of its sequence the prefix cache holds: all but
        the last token (whose logits it samples from), and none of the positions whose logits its
        prompt logprobs need."""
        pool = self.pool
        row.epoch = pool.epoch
        row.blocks = pool.match(row.sequence, (len(row.sequence) - max(1, row.prompt_positions)) // pool.block_size)
        row.computed = len(row.blocks) * pool.block_size
        row.cached_tokens += row.computed
        self.cached_tokens += row.computed

    def prefill_progress(self) -> dict[tuple[int, ...], int]:
        """Per sequence being prefilled, the least progress (`computed`) of the rows leading its
        prefill: a new row of it can follow one of them iff `can_follow` at that progress."""
        progress: dict[tuple[int, ...], int] = {}
        for row in self.pending:
            if row.finish is None:
                sequence = row.sequence
                progress[sequence] = min(row.computed, progress.get(sequence, row.computed))
        return progress

    def drop_finished(self) -> None:
        """Free the blocks of finished rows; a finished leader hands its work to its first live follower."""
        keep = [i for i, row in enumerate(self.ready) if row.finish is None]
        if len(keep) < len(self.ready):
            for row in self.ready:
                if row.finish is not None:
                    self._free(row)
            self.ready = [self.ready[i] for i in keep]
            if self._table is not None:  # keep is ascending: the kept rows it holds stay first
                self._table = self._table[[i for i in keep if i < len(self._table)]]
            index = to_device(keep, self.logits.device, torch.int64)
            self.logits = self.logits[index] if keep else None
            self.sampling = self.sampling.select(index) if keep and self.sampling is not None else None
        pending = []
        for leader in self.pending:
            followers = [row for row in self.followers.pop(id(leader), []) if row.finish is None]
            if leader.finish is not None and followers:  # the first follower takes over the cache
                heir = followers.pop(0)
                heir.blocks, heir.computed, leader.blocks = leader.blocks, leader.computed, []
                heir.epoch = leader.epoch
                if id(leader) in self._prompt_logits:
                    self._prompt_logits[id(heir)] = self._prompt_logits.pop(id(leader))
                leader = heir
            if leader.finish is None:
                pending.append(leader)
                if followers:
                    self.followers[id(leader)] = followers
            else:
                self._free(leader)
                self._prompt_logits.pop(id(leader), None)
        self.pending = pending
        if self.waiting:
            self.waiting = {key: live for key, rows in self.waiting.items()
                            if (live := [row for row in rows if row.finish is None])}
            self._release_waiting()  # those whose leader ended or left

    def release_all(self) -> list[Row]:
        """Free every block; returns the live rows (all without cache now), ready ones first."""
        rows = [row for row in self.rows if row.finish is None]
        for row in self.rows:
            self._free(row)
        self.ready, self.pending, self.logits, self.sampling, self._table = [], [], None, None, None
        self.followers.clear()
        self.waiting.clear()
        self._prompt_logits.clear()
        return rows

    def _free(self, row: Row) -> None:
        """Hand a row's blocks back, its computed full ones to the prefix cache."""
        self.pool.register(row.blocks, row.sequence[: row.computed], row.epoch)
        self.pool.release(row.blocks)
        row.blocks, row.computed = [], 0

    # ---- one forward ----------------------------------------------------------------------------

    def _plan(self) -> tuple[list[tuple[Row, int]], int]:
        """The pending rows' chunks of this forward (row, tokens) and the blocks the forward needs."""
        budget = self.chunk_tokens if self.chunk_tokens is not None else float("inf")
        chunks = []
        for row in self.pending:
            if budget <= 0:
                break
            n = min(len(row.sequence) - row.computed, budget)
            chunks.append((row, int(n)))
            budget -= n
        size = self.pool.block_size
        need = sum(len(row.blocks) * size <= row.computed for row in self.ready)  # a row's next token starts a block
        need += sum(self.pool.blocks_for(row.computed + n) - len(row.blocks) for row, n in chunks)
        # A leader's followers each copy its last block when it completes.
        need += sum(len(self.followers.get(id(row), ())) for row, n in chunks
                    if row.computed + n == len(row.sequence) and (row.computed + n) % self.pool.block_size)
        return chunks, need

    def make_room(self) -> list[Row]:
        """Retract the newest rows until the next forward's blocks are free; returns them (live,
        blocks freed), oldest first. The oldest row is never retracted: alone it always fits."""
        retracted: list[Row] = []
        while self._plan()[1] > self.pool.free_blocks:
            waiting = next((rows for rows in reversed(self.followers.values()) if rows), None)
            if waiting is not None:  # a follower holds nothing yet, but would copy a block
                retracted.insert(0, waiting.pop())
                continue
            if len(self.pending) > (0 if self.ready else 1):
                victim = self.pending.pop()
                self._prompt_logits.pop(id(victim), None)
            elif len(self.ready) > 1:
                victim = self.ready.pop()
                self.logits, self.sampling = self.logits[:-1], None
                if self._table is not None:
                    self._table = self._table[: len(self.ready)]
            else:
                raise RuntimeError("the KV pool cannot hold a single request: it is smaller than its budget says")
            retracted.insert(0, victim)
            self._free(victim)
        return retracted

    def forward(self, keep: dict[int, int], fed: torch.Tensor | None = None) -> tuple[int, int, list[Prefilled]]:
        """Feed the ready rows their newest token and the pending rows their next chunk (after
        `make_room`). `keep`: id(leader) -> how many of its sequence's last positions' logits to
        return (prompt logprobs). `fed`: the ready rows' newest tokens [len(ready)] on the device,
        sampled and not yet appended to them (the engine's overlap schedule); None: each row's last
        output. Sets `logits`; returns the decode rows' and the prefill chunks' token counts, and
        the rows whose prefill completed."""
        chunks, _ = self._plan()
        decode, size = len(self.ready), self.pool.block_size
        grown = self._take_blocks(chunks)
        # The decode rows' inputs, on the host in numpy (one pass over the rows, none over their
        # blocks): each feeds its newest token (the last output: a ready row has sampled one) at
        # position `computed`, its context's length.
        lengths = np.fromiter((row.computed + 1 for row in self.ready), np.int64, decode)
        feed = (np.zeros(decode, np.int64) if fed is not None  # written on the device below
                else np.fromiter((row.output_ids[-1] for row in self.ready), np.int64, decode))
        width = int(lengths.max()) if decode else 0
        table = self._decode_table(grown, self.pool.blocks_for(width))
        position = lengths - 1
        into = table[np.arange(decode), position // size] * size + position % size
        prefill = PrefillInputs.of(chunks, keep, decode, size, self.pool.device)
        (step_tokens, step_positions, step_write, step_lengths, step_table, step_logits_at) = upload(
            [feed, prefill.tokens], [position, prefill.positions], [into, prefill.write], lengths,
            table.reshape(-1), prefill.logits_at, self.pool.device)
        if fed is not None:
            step_tokens[:decode].copy_(fed)
        step = Forward(
            tokens=step_tokens, positions=step_positions, write=step_write,
            decode=decode, decode_table=step_table.view(table.shape), decode_lengths=step_lengths,
            decode_width=width, block_size=size,
            spans=spans(lengths.tolist()) if self.model.batch_invariant else None, chunks=prefill.chunks,
            logits_at=step_logits_at)
        logits = self._run(step)
        for row in self.ready:
            row.computed += 1
        for row, n in chunks:
            row.computed += n
        for row, at, count in prefill.wanted:
            if count:
                self._prompt_logits.setdefault(id(row), []).append(logits[at: at + count])
        done = [row for row, _ in chunks if row.computed == len(row.sequence)]
        if self.pool.prefix_cache:
            for row in done:  # a later row of the same prefix takes its blocks (`_shared_prefill`)
                self._register(row)
        completed = self._complete(logits[:decode],
                                   {id(row): logits[at + max(count - 1, 0)] for row, at, count in prefill.wanted}, done)
        if self.waiting:
            self._release_waiting()
        return decode, len(prefill.tokens), completed

    def _take_blocks(self, chunks: list[tuple[Row, int]]) -> list[int]:
        """Give the rows the blocks this forward writes into; returns the ready rows that took one
        (their newest token starts a block)."""
        pool, size = self.pool, self.pool.block_size
        grown = []
        for i, row in enumerate(self.ready):
            if len(row.blocks) * size <= row.computed:
                row.blocks += pool.allocate(1)
                grown.append(i)
        for row, n in chunks:
            row.blocks += pool.allocate(pool.blocks_for(row.computed + n) - len(row.blocks))
        return grown

    def _run(self, step: Forward) -> torch.Tensor:
        """The model's forward (replayed as a CUDA graph where one fits), timed if asked."""
        if self.timer is not None:
            self.timer.forward_launching()
        logits = (self.runner or self.model).forward(step, self.pool)
        if self.timer is not None:
            self.timer.forward_launched()
        return logits

    def _decode_table(self, grown: list[int], columns: int) -> np.ndarray:
        """The ready rows' block tables [len(ready), columns] (padded with block 0), the rows
        `grown` having just taken one block each: from the table kept since the last step, only
        those rows written (and the rows appended since, built)."""
        kept = self._table
        built = 0 if kept is None else len(kept)
        if kept is None or kept.shape[1] < columns:  # room for the longest, with spare columns
            wider = np.zeros((built, max(2 * columns, 16)), dtype=np.int64)
            if built:
                wider[:, : kept.shape[1]] = kept
            kept = wider
        for i in grown:
            if i < built:
                blocks = self.ready[i].blocks
                kept[i, len(blocks) - 1] = blocks[-1]
        if built < len(self.ready):
            added = np.zeros((len(self.ready) - built, kept.shape[1]), dtype=np.int64)
            for i, row in enumerate(self.ready[built:]):
                added[i, : len(row.blocks)] = row.blocks
            kept = np.concatenate([kept, added])
        self._table = kept
        return kept[:, :columns]

    def _complete(self, decoded: torch.Tensor, last: dict[int, torch.Tensor], done: list[Row]) -> list[Prefilled]:
        """Ready rows' new logits, and the completed leaders and their forks joining them."""
        completed, joining = [], [decoded]
        for leader in done:
            followers = self.followers.pop(id(leader), [])
            for row in followers:
                row.blocks, row.computed = self.pool.fork(leader.blocks, leader.computed), leader.computed
            parts = self._prompt_logits.pop(id(leader), None)
            completed.append(Prefilled(leader, followers, None if parts is None else torch.cat(parts)))
            joining.append(last[id(leader)].expand(1 + len(followers), -1))
            self.ready += [leader, *followers]
            self.sampling = None
        self.pending = [row for row in self.pending if row.computed < len(row.sequence)]
        self.logits = torch.cat(joining) if len(joining) > 1 else decoded
        return completed


def can_follow(computed: int, row: Row) -> bool:
    """Whether `row` can follow the prefill of its sequence once that has computed `computed`
    tokens: the positions it needs logits of (`Row.prompt_positions`) are all still to come, so
    the forwards ahead keep them for it (the engine's keep counts its followers)."""
    return computed <= len(row.sequence) - row.prompt_positions
