"""Sample dumps: every `dump.every_steps`-th step, the samples a trainer rank trained, for reading.

One JSON object per sample in `<run_dir>/dumps/step-NNNNNNNN-rankR.jsonl` (NNNNNNNN: the step as the
metrics rows count it, from 1), written to a temporary file and renamed, so that a reader never
sees part of a file. Each object:

    step, rank, uid, group_id, index, prompt_id
    prompt, answer         the prompt and answer tokens decoded (special tokens kept: what was trained)
    fields                 the dataset row's text fields (the reference answer, ...)
    reward, scalars        the train node's reward, and every scalar of the sample
    finish                 how generation ended: stop | length (truncated) | abort
    lengths                {"prompt": tokens, "answer": tokens, "trained": answer tokens in the loss}
    versions               {version: answer tokens it generated} (JSON keys are strings); {} without versions
    staleness              step − the oldest version among its tokens (the step counted from 0, as the
                           weights' versions are); None without versions
    staleness_mean         the token-weighted mean of step − version; None without versions
    advantage              the mean advantage over the answer's tokens in the loss; None without any
    advantages             the advantage of every answer token (rounded to 6 significant digits)
    turns                  a multi-turn answer (one with a loss_mask key) in its parts, in order:
                           [{"by": "policy" | "env", "tokens": n, "text": decoded}]; None otherwise
    arrays                 with `dump.tokens`: every array of the sample as a list ({key: [...]}: the
                           prompt and answer ids, behav_logprobs, prox_logprobs, versions, ...), exact
                           (a float32 round-trips through JSON's doubles)

With `dump.weights`, the trainer also saves the weights it starts each step from, as a Hugging Face
directory `<run_dir>/dumps/weights/vNNNNNNNN` (`weights_path`): the version that step's π_prox is,
and the version the servers loaded under that number; with LoRA, the weights merged and, in
`adapter/` (`adapter_path`), the adapters as the servers got them (a PEFT adapter directory). With
both, every trained token's behaviour and π_prox logprobs can be recomputed offline
(tests/test_logprob_audit.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence

import numpy as np

from areal_flow.runtime import run_dir as rd
from areal_flow.runtime.disk import write_atomic
from areal_flow.transport.messages import Sample

DUMPS = rd.DUMPS


def weights_path(run_dir: str, version: int) -> str:
    """Where `dump.weights` keeps the weights of `version`."""
    return os.path.join(run_dir, DUMPS, "weights", f"v{version:08d}")


def adapter_path(run_dir: str, version: int) -> str:
    """Where `dump.weights` keeps the LoRA adapters of `version` (inside its weights' directory)."""
    return os.path.join(weights_path(run_dir, version), "adapter")


def dump_due(every_steps: int, step: int) -> bool:
    """Whether step `step` (counted from 0) is dumped: step + 1 a multiple of `every_steps` (0: never)."""
    return every_steps > 0 and (step + 1) % every_steps == 0


def dump_path(run_dir: str, step: int, rank: int) -> str:
    """The dump of step `step` (counted from 0; the name counts from 1, as the metrics rows) by `rank`."""
    return os.path.join(run_dir, DUMPS, f"step-{step + 1:08d}-rank{rank}.jsonl")


def sample_record(sample: Sample, *, step: int, rank: int, prompt_key: str, output_key: str, reward_key: str,
                  versions_key: str | None, advantages: np.ndarray | None, mask: np.ndarray | None,
                  decode: Callable[[np.ndarray], str], arrays: bool = False,
                  loss_mask_key: str | None = None) -> dict:
    """One sample's dump object (the module's docstring); `step` counted from 0, `mask` the answer
    tokens in the loss (None: all), `decode` token ids to text, `arrays` whether to add every array,
    `loss_mask_key` the key of the generate node's loss_mask (who wrote each token)."""
    prompt, output = sample.array(prompt_key), sample.array(output_key)
    mask = np.ones(len(output), dtype=bool) if mask is None else np.asarray(mask, dtype=bool)
    versions = sample.array(versions_key) if versions_key and versions_key in sample.arrays else None
    counts: dict[str, int] = {}
    staleness = staleness_mean = None
    if versions is not None and len(versions):
        values, n = np.unique(versions, return_counts=True)
        counts = {str(int(v)): int(c) for v, c in zip(values, n)}
        staleness = int(step - values.min())
        staleness_mean = float(np.mean(step - versions.astype(np.float64)))
    adv = np.asarray(advantages, dtype=np.float64) if advantages is not None else None
    record = {
        "step": step + 1, "rank": rank, "uid": sample.uid, "group_id": sample.group_id, "index": sample.index,
        "prompt_id": sample.prompt_id,
        "prompt": decode(prompt), "answer": decode(output), "fields": dict(sample.fields),
        "reward": sample.scalars.get(reward_key), "scalars": dict(sample.scalars),
        "finish": sample.finish.value,
        "lengths": {"prompt": int(len(prompt)), "answer": int(len(output)), "trained": int(mask.sum())},
        "versions": counts, "staleness": staleness, "staleness_mean": staleness_mean,
        "advantage": float(adv[mask].mean()) if adv is not None and mask.any() else None,
        "advantages": [float(f"{a:.6g}") for a in adv] if adv is not None else None,
        "turns": (turn_parts(output, sample.array(loss_mask_key), decode)
                  if loss_mask_key and loss_mask_key in sample.arrays else None),
    }
    if arrays:
        record["arrays"] = {k: sample.array(k).tolist() for k in sorted(sample.arrays)}
    return record


def turn_parts(output: np.ndarray, written_by_policy: np.ndarray, decode: Callable[[np.ndarray], str]) -> list[dict]:
    """The answer cut where the writer changes: the policy's turns (mask 1) and the environment's
    observations (mask 0), each decoded on its own."""
    policy = np.asarray(written_by_policy) != 0
    cuts = [0, *(np.flatnonzero(policy[1:] != policy[:-1]) + 1).tolist(), len(output)]
    return [{"by": "policy" if policy[a] else "env", "tokens": b - a, "text": decode(output[a:b])}
            for a, b in zip(cuts, cuts[1:]) if b > a]


def write_dump(path: str, records: Sequence[dict]) -> None:
    """`records` as JSON lines at `path`, written whole (runtime/disk.py: write_atomic): a record
    that cannot be serialised fails before anything is written."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    write_atomic(path, "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records))


def dump_step(run_dir: str, step: int, rank: int, samples: Sequence[Sample], *, prompt_key: str, output_key: str,
              reward_key: str, versions_key: str | None, advantages: Sequence[np.ndarray] | None,
              masks: Sequence[np.ndarray] | None, decode: Callable[[np.ndarray], str], arrays: bool = False,
              loss_mask_key: str | None = None) -> str:
    """Write the dump of step `step` (from 0) by `rank`: one object per sample, in order, with its
    advantages and loss mask (per sample, in the samples' order; None: unknown / all valid).
    Returns the file's path."""
    records = [sample_record(s, step=step, rank=rank, prompt_key=prompt_key, output_key=output_key,
                             reward_key=reward_key, versions_key=versions_key,
                             advantages=None if advantages is None else advantages[i],
                             mask=None if masks is None else masks[i], decode=decode, arrays=arrays,
                             loss_mask_key=loss_mask_key)
               for i, s in enumerate(samples)]
    path = dump_path(run_dir, step, rank)
    write_dump(path, records)
    return path
