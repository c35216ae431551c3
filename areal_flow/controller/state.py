"""The controller's state: one typed object holding everything the control plane counts and decides
from, saved in every checkpoint (`run_state.json`) so that a resumed run goes on as if it had
never stopped (docs/reliability.md).

It holds plain values only: the staleness accounting and the intake (scored groups, by id, and the
trainer rank holding each) as they are, the prompt stream's position, the counters the metrics
report, and the prompt of every group still generating, which a resumed run admits again (its
samples were lost with the processes that generated them). The scored groups' tokens are not
here: each trainer rank saves the ones it holds beside it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

import msgspec

from areal_flow.checkpoint import store
from areal_flow.config.schema import RunConfig
from areal_flow.controller.intake import Intake
from areal_flow.controller.staleness import StalenessManager
from areal_flow.graph.keys import KEYS
from areal_flow.runtime import run_dir as rd

FILE = rd.RUN_STATE


@dataclass
class RunState:
    staleness: StalenessManager  # versions, running and finished groups (controller/staleness.py)
    intake: Intake  # scored groups not yet trained, and the rank holding each (controller/intake.py)
    step: int = 0  # train steps done
    next_group: int = 0  # the id the next admitted prompt group gets
    epoch: int = 0  # the prompt stream's pass over the training set
    cursor: int = 0  # ... and its position in that pass
    running_prompts: dict[int, int] = field(default_factory=dict)  # group id -> its prompt's row, admitted and not scored
    filtered: int = 0  # groups dropped by dynamic filtering, in all
    filtered_logged: int = 0  # ... up to the last metrics row
    generated_tokens: int = 0  # answer tokens generated since the last metrics row
    trainer_seconds: float = 0.0  # seconds the trainer ranks spent on steps, in all
    train_elapsed: float = 0.0  # training-clock seconds when this state was saved
    ledger_bytes: int = 0  # ledger.jsonl's length when saved: what a resumed run keeps of it
    metrics_bytes: int = 0  # metrics.jsonl's length when saved
    resumes: int = 0  # how many times this run has been resumed

    def trained_groups(self) -> int:
        """Groups trained so far: every admitted group is running, buffered, dropped, filtered or trained."""
        return (self.next_group - len(self.staleness.running) - len(self.intake) - self.intake.dropped
                - self.filtered)


def new_state(cfg: RunConfig, graph, n_trainers: int) -> RunState:
    """A new run's state: nothing admitted, nothing scored; the intake checks the keys the graph's
    generate node (and its judges) write."""
    algo, gen = cfg.algorithm, graph.generate
    keys = {graph.meaning[k]: k for k in gen.outputs}
    return RunState(
        staleness=StalenessManager(algo.batch_size, cfg.rollout.max_staleness, cfg.rollout.max_concurrent),
        intake=Intake(
            algo.group_size, n_trainers, token_keys=[*gen.outputs, *(k for j in graph.judges for k in j.outputs)],
            output_keys=[keys["output_ids"]] + [k for m, k in keys.items() if KEYS[m].per == "output" and m != "output_ids"],
            prompt_key=keys["prompt_ids"], reward_key=graph.input(graph.train, "rewards"),
        ))


def encode(state: RunState, readmit: list[int], versions: dict[int, int] | None = None) -> bytes:
    """The state as a checkpoint saves it; `readmit`: groups a resumed run has yet to admit again,
    still running as far as a later resume goes (at their `versions` where given: they keep
    trajectories, controller/kept.py; else at the version now)."""
    versions = versions or {}
    running = {**state.staleness.running, **{g: versions.get(g, state.staleness.version) for g in readmit}}
    return msgspec.json.encode(replace(state, staleness=replace(state.staleness, running=running)))


def save(state: RunState, folder: str) -> None:
    with open(os.path.join(folder, FILE), "wb") as f:
        f.write(msgspec.json.encode(state))


def load(folder: str) -> RunState:
    with open(os.path.join(folder, FILE), "rb") as f:
        return msgspec.json.decode(f.read(), type=RunState)


def resume(folder: str, n_trainers: int) -> tuple[RunState, dict[int, int]]:
    """The state of the resumable checkpoint `folder`, placed on `n_trainers` ranks, and the groups
    that were generating, to admit again, with the versions they were admitted at (their samples
    were lost with the processes, but for the trajectories the checkpoint kept: controller/kept.py;
    the launcher has cut the ledger and the metrics back to what they held then:
    checkpoint/store.py `rewind`)."""
    state = load(folder)
    if store.read_manifest(folder)["n_trainers"] != n_trainers:
        for_ranks(state, n_trainers)
    running = dict(sorted(state.staleness.running.items()))
    state.staleness.running = {}
    state.resumes += 1
    return state, running


def for_ranks(state: RunState, n_ranks: int) -> None:
    """A state saved with another number of trainer ranks: the groups rank k held are now held by
    rank k mod n_ranks (each rank loads the saved groups of the ranks that map to it)."""
    state.intake.n_ranks = n_ranks
    state.intake.location = {g: rank % n_ranks for g, rank in state.intake.location.items()}
