"""The running decode batch: per-request rows and a KV cache that grows in place.

Rows of finished requests stay in the batch until the next join or compaction (`Batch.combine`),
so most decode steps copy nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, DynamicLayer

from areal_flow.generation.engine.requests import GenerationRequest, GenerationResult
from areal_flow.generation.engine.sampling import RowSampling

class GrowingLayer(DynamicLayer):
    """One layer's KV cache in a buffer with room to spare at the end.

    transformers' DynamicLayer appends with torch.cat, re-copying the whole cache every decode step;
    writing into spare room instead made batch-64 decoding about 1.5x faster. `keys`/`values` stay
    views of the filled part, so everything else in transformers reads this layer as a DynamicLayer.
    """

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self._keys = self._values = key_states[:, :, :0]
        self._length = 0
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self._length + key_states.shape[-2]
        if end > self._keys.shape[-2]:
            keys = _spacious_like(key_states, end)
            values = torch.empty_like(keys)
            keys[:, :, : self._length] = self._keys[:, :, : self._length]
            values[:, :, : self._length] = self._values[:, :, : self._length]
            self._keys, self._values = keys, values
        self._keys[:, :, self._length: end] = key_states
        self._values[:, :, self._length: end] = value_states
        self._set_length(end)
        return self.keys, self.values

    def _set_length(self, length: int) -> None:
        self._length = length
        self.keys, self.values = self._keys[:, :, :length], self._values[:, :, :length]

    @classmethod
    def gather(cls, parts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]], width: int
               ) -> GrowingLayer:
        """A layer holding rows `index` of each part's (keys, values) from column `start` on,
        right-aligned to `width` columns (left padding is zeros, masked by the caller: zeros rather
        than garbage, because a masked score must stay finite before the mask makes it -inf)."""
        rows = sum(len(index) for _, _, index, _ in parts)
        first = parts[0][0]
        layer = cls()
        layer.lazy_initialization(first, first)
        layer._keys = _spacious_like(first, width, rows=rows)
        layer._values = torch.empty_like(layer._keys)
        offset = 0
        for keys, values, index, start in parts:
            n, w = len(index), keys.shape[-2] - start
            for buffer, source in ((layer._keys, keys), (layer._values, values)):
                buffer[offset: offset + n, :, :width - w] = 0
                buffer[offset: offset + n, :, width - w: width] = source[index, :, start:]
            offset += n
        layer._set_length(width)
        return layer


def _spacious_like(like: torch.Tensor, length: int, rows: int | None = None) -> torch.Tensor:
    """A [rows, heads, capacity, dim] buffer with capacity ~2x length: amortised O(1) copies per step.
    Uninitialised: only the first `length` columns are ever read, after they are written."""
    shape = (like.shape[0] if rows is None else rows, like.shape[1], max(2 * length, 64), like.shape[-1])
    return like.new_empty(shape)


@dataclass
class Row:
    """One request while it waits or decodes."""

    request: GenerationRequest
    future: Future
    stop_ids: frozenset[int]
    decode: Callable[[list[int]], str] | None = None  # for stop strings
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)  # per generated token, if asked
    input_logprobs: list[float | None] = field(default_factory=list)  # from the prefill, if asked
    input_top_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    finish: tuple[str, int | str | None] | None = None
    retractions: int = 0
    # The weights that computed the logits this row samples from next: its next token's version.
    # (Held in place across an update, the first token after it still comes from the old weights.)
    logits_version: int = 0
    # The paged cache (generation/engine/paged_batch.py): the row's blocks, and how many of its sequence's
    # tokens have their keys and values there.
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    epoch: int = 0  # the pool's prefix-cache epoch when its keys began: older ones are never cached
    cached_tokens: int = 0  # tokens its prefills took from the prefix cache (SGLang's meta_info.cached_tokens)

    def append(self, token: int, logprob: float, version: int) -> None:
        self.output_ids.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)
        if token in self.stop_ids:
            self.finish = ("stop", token)
        elif (matched := self._stop_string()) is not None:
            self.finish = ("stop", matched)
        elif len(self.output_ids) >= self.request.params.max_new_tokens:
            self.finish = ("length", None)

    def result(self, finish: tuple[str | None, int | str | None], version: int, label: str,
               adapter_digest: str | None = None) -> GenerationResult:
        """The row's answer so far, finished by `finish` (reason, matched stop; (None, None) for a
        partial one), under the weights of `version` and `label` (and their adapters' digest, with
        LoRA updates). Its lists are the row's own."""
        request = self.request
        return GenerationResult(
            rid=request.rid, prompt_tokens=len(request.input_ids), output_ids=self.output_ids,
            output_logprobs=self.logprobs, output_versions=self.versions, finish_reason=finish[0],
            matched_stop=finish[1], weight_version=version, retractions=self.retractions,
            weight_label=label, output_top_logprobs=self.top_logprobs, input_logprobs=self.input_logprobs,
            input_top_logprobs=self.input_top_logprobs, cached_tokens=self.cached_tokens,
            adapter_digest=adapter_digest,
        )

    def _stop_string(self) -> str | None:
        """The first stop string in the decoded tail of the output. The tail is long enough to hold
        the longest one: a token decodes to at least one byte, and a character is at most four."""
        stop = self.request.params.stop
        if not stop or self.decode is None:
            return None
        tail = self.decode(self.output_ids[-(4 * max(len(s) for s in stop) + 2):])
        return next((s for s in stop if s in tail), None)

    @property
    def sequence(self) -> tuple[int, ...]:
        """What a prefill must compute: the prompt, and the tokens so far of a retracted row."""
        return self.request.input_ids + tuple(self.output_ids)

    @property
    def prompt_positions(self) -> int:
        """How many of the last positions of its sequence a prefill must keep the logits of for this
        row's prompt logprobs (from logprob_start_len on); 0: none (a retracted row has them already)."""
        if self.request.logprob_start_len is None or self.output_ids:
            return 0
        return len(self.request.input_ids) - self.request.logprob_start_len

    @property
    def kv_tokens(self) -> int:
        """The most KV cache slots this request can come to hold: prompt + max_new_tokens."""
        return len(self.request.input_ids) + self.request.params.max_new_tokens

    @property
    def last_position(self) -> int:
        """Position id of the newest token, which is the next one fed to the model."""
        return len(self.request.input_ids) + len(self.output_ids) - 1

    @property
    def next_position(self) -> int:
        """Position of the token the row samples next (a seeded row's random number is keyed by it)."""
        return len(self.request.input_ids) + len(self.output_ids)


@dataclass
class Batch:
    """Rows decoding together. The KV cache is left-padded to one width; `mask` [B, width] marks the
    real positions; `logits` [B, V] are what each row samples its next token from.

    A finished row stays in the batch as a dead row until the next `combine` (its outputs are
    ignored): compacting copies the whole cache, so the engine does it only when new rows join or
    enough rows are dead.
    """

    rows: list[Row]
    cache: Cache
    mask: torch.Tensor
    logits: torch.Tensor
    sampling: RowSampling = field(init=False)  # built once per membership change, not per step

    def __post_init__(self) -> None:
        self.sampling = RowSampling.of([row.request.params for row in self.rows], self.logits.device)

    def live(self) -> list[int]:
        return [i for i, row in enumerate(self.rows) if row.finish is None]

    def live_rows(self) -> list[Row]:
        return [row for row in self.rows if row.finish is None]

    @staticmethod
    def combine(parts: Sequence[tuple[Batch, list[int]]]) -> Batch | None:
        """The rows `keep` of each batch in one batch, with one copy of the cache: each part is
        right-aligned to the widest, and columns that no kept row attends to are dropped."""
        parts = [(batch, keep) for batch, keep in parts if keep]
        if not parts:
            return None
        pieces = []  # (batch, index, first column any kept row of the batch attends to)
        for batch, keep in parts:
            index = torch.tensor(keep, device=batch.mask.device)
            pieces.append((batch, index, int(batch.mask[index].any(dim=0).int().argmax())))
        kept_rows = [batch.rows[i] for batch, keep in parts for i in keep]
        width = max(batch.mask.shape[1] - start for batch, _, start in pieces)
        layers = [
            GrowingLayer.gather(
                [(b.cache.layers[i].keys, b.cache.layers[i].values, index, start) for b, index, start in pieces], width)
            for i in range(len(pieces[0][0].cache.layers))
        ]
        mask = torch.cat([F.pad(b.mask[index, start:], (width - (b.mask.shape[1] - start), 0))
                          for b, index, start in pieces])
        return Batch(
            kept_rows,
            Cache(layers=layers),
            mask,
            torch.cat([b.logits[index] for b, index, _ in pieces]),
        )
