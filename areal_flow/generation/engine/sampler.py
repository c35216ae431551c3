"""Where a decode step's tokens go: sampled from the batch's logits, read back to the host and
appended to their rows (tagged with the weight version that made the logits), the rows that
finish set aside to be answered, and listeners told of each token. It keeps the version and label
of the weights being served, which every token and answer carries. Prompt logprobs from a
prefill's logits are written into the rows here too. Both steppers (dense_stepper.py,
paged_stepper.py) share one Sampler, which owns the engine's sampling generator."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from areal_flow.generation.engine.kv_batch import Row
from areal_flow.generation.engine.requests import GenerationResult
from areal_flow.generation.engine.sampling import RowSampling, sample, scaled_logprobs, top_logprobs
from areal_flow.generation.engine.step_timing import StepTimer
from areal_flow.runtime.devices import to_device

logger = logging.getLogger(__name__)


@dataclass
class Drawn:
    """Sampled tokens on their way to the host: the rows they are for, the tokens [B] int64 on the
    device, and one host buffer [2B] int64 that a copy launched with them fills (the float32
    logprobs travel as their bits, sign-extended into int64, and come back bit for bit: one
    transfer and one wait, not one each)."""

    rows: list[Row]
    tokens: torch.Tensor
    host: torch.Tensor
    copied: torch.cuda.Event | None  # recorded after the copy (CUDA); None: the copy is done

    @classmethod
    def launch(cls, rows: list[Row], tokens: torch.Tensor, logprobs: torch.Tensor) -> Drawn:
        both = torch.cat([tokens, logprobs.float().view(torch.int32).to(torch.int64)])
        if tokens.device.type != "cuda":
            return cls(rows, tokens, both, None)
        # Into pinned memory without waiting: the copy is queued before the next forward, so
        # waiting for it later waits for the sampling alone.
        host = torch.empty(both.shape, dtype=torch.int64, pin_memory=True)
        host.copy_(both, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return cls(rows, tokens, host, copied)

    def read(self) -> tuple[list[int], np.ndarray]:
        """The tokens as a list and their logprobs as float32, once the copy is done."""
        if self.copied is not None:
            self.copied.synchronize()
        both = self.host.numpy()
        rows = len(both) // 2
        return both[:rows].tolist(), both[rows:].astype(np.int32).view(np.float32)


class Sampler:
    """Samples and appends the rows' tokens (see the module docstring); used on the decode thread only."""

    def __init__(self, device: torch.device, seed: int, version: int, label: str, timer: StepTimer | None) -> None:
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.version = version
        """The weight version the model's logits come from now: the version of every token sampled from them."""
        self.label = label
        """Those weights' label (SGLang's weight_version string), which every answer carries."""
        self.adapter_digest: str | None = None
        """The digest of the adapters merged into those weights (LoRA updates: weights/adapter.py),
        which every answer carries too; None: full weights."""
        self.timer = timer
        self.finished: list[Row] = []
        """Rows that ended since the engine last took them, to be answered once the step's counts are in."""
        self.generated_tokens = 0

    def result(self, row: Row, finish: tuple[str | None, int | str | None]) -> GenerationResult:
        """`row`'s answer under the weights served now."""
        return row.result(finish, self.version, self.label, self.adapter_digest)

    def take_finished(self) -> list[Row]:
        rows, self.finished = self.finished, []
        return rows

    def sample(self, rows: list[Row], logits: torch.Tensor, sampling: RowSampling) -> tuple[int, torch.Tensor]:
        """Sample a token for every live row of `rows` from `logits` [len(rows), V] and append it;
        set aside the rows that finish. Returns how many rows are still live, and the tokens."""
        drawn = self.launch(rows, logits, sampling)
        return self.take(drawn), drawn.tokens

    def launch(self, rows: list[Row], logits: torch.Tensor, sampling: RowSampling) -> Drawn:
        """Launch the sampling of a token for every row of `rows` from `logits` [len(rows), V], and
        the copy of the tokens and their logprobs to the host, without waiting for either."""
        positions = None if sampling.seeded is None else to_device(
            [row.next_position for row in rows], logits.device, torch.int64)
        timer = self.timer
        if timer is not None:
            timer.sample_launching()
        tokens, logprobs = sample(logits, sampling, positions, self.generator)
        if timer is not None:
            timer.sample_launched()
        self._top_logprobs(rows, logits, sampling.temperature)
        return Drawn.launch(rows, tokens, logprobs)

    def take(self, drawn: Drawn) -> int:
        """Wait for `drawn`'s tokens and append each to its row (the live ones); set aside the rows
        that finish. Returns how many rows are still live."""
        token_list, logprobs = drawn.read()  # the step's one wait for the device
        if self.timer is not None:
            self.timer.mark("readback")
        rows = drawn.rows
        if np.isnan(logprobs).any():
            bad = rows[int(np.flatnonzero(np.isnan(logprobs))[0])].request.rid
            raise FloatingPointError(f"the model's logits for request {bad} hold NaN (broken weights?)")
        alive = 0
        for row, token, logprob in zip(rows, token_list, logprobs.tolist()):
            if row.finish is not None:
                continue  # dead row: decodes along, unused, until the next compaction
            row.append(token, logprob, row.logits_version)
            row.logits_version = self.version  # the forward that follows computes its next logits
            self.generated_tokens += 1
            if row.finish is None:
                alive += 1
                if row.request.on_token is not None:
                    self._report(row)
            else:
                self.finished.append(row)
        return alive

    def _report(self, row: Row) -> None:
        try:
            row.request.on_token(self.result(row, (None, None)))
        except Exception:  # a faulty listener must not fail the batch
            logger.exception("on_token of request %s failed", row.request.rid)

    def _top_logprobs(self, rows: list[Row], logits: torch.Tensor, temperature: torch.Tensor) -> None:
        """Append the most likely tokens of this step to the live rows that asked for them, from the
        distribution they sample from (temperature-scaled, as their output logprobs)."""
        asked = [i for i, row in enumerate(rows) if row.finish is None and row.request.top_logprobs_num]
        if not asked:
            return
        logprobs = scaled_logprobs(logits[asked], temperature[asked])
        for i, row_logprobs in zip(asked, logprobs):
            row = rows[i]
            row.top_logprobs.append(top_logprobs(row_logprobs, row.request.top_logprobs_num))

    def prompt_logprobs(self, rows: list[Row], logits: torch.Tensor) -> None:
        """Fill the prompt logprobs of the rows that asked for them from the prefill's logits
        [B, keep, V] (the last `keep` positions); set aside the rows that only wanted those."""
        keep = logits.shape[1]
        for row, row_logits in zip(rows, logits):
            request = row.request
            if request.logprob_start_len is None or row.output_ids:
                continue
            ids, start = request.input_ids, request.logprob_start_len
            if len(ids) - start > keep:  # a slice past the start would silently read other positions
                raise RuntimeError(f"request {request.rid}: its prefill kept the logits of {keep} prompt "
                                   f"positions, its prompt logprobs need {len(ids) - start}")
            # Position p's logits predict token p + 1: tokens start+1 .. n-1 need positions start .. n-2.
            logprobs = torch.log_softmax(row_logits[keep - (len(ids) - start): keep - 1].float(), dim=-1)
            targets = torch.tensor(ids[start + 1:], dtype=torch.int64, device=logprobs.device)
            head: list[Any] = [None] if start < len(ids) else []
            row.input_logprobs = head + logprobs.gather(1, targets[:, None]).squeeze(1).tolist()
            if request.top_logprobs_num:
                row.input_top_logprobs = head + [top_logprobs(lp, request.top_logprobs_num) for lp in logprobs]
            if request.params.max_new_tokens == 0:  # prefill-only scoring
                row.finish = ("length", None)
                self.finished.append(row)
