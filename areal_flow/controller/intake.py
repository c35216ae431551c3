"""Intake: the controller's index of scored groups, by id, and the rank that holds each.

It holds metadata only (`GroupMeta`: sizes, versions, rewards), never tokens. A scored group that
cannot be trained is refused with the reason; a usable one is routed to the trainer rank that holds
the fewest untrained tokens, and stays indexed there until a step takes it. Its state is plain
values, so a later checkpoint can save it as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from areal_flow.transport.messages import DROP, GroupMeta


def group_problem(meta: GroupMeta, group_size: int, token_keys: list[str], output_keys: list[str],
                  reward_key: str) -> str | None:
    """What makes a scored group untrainable, if anything: a wrong sample count, a missing key, or
    per-answer-token arrays of one sample (`output_keys`) that disagree in length, or the problem
    the rollout worker named (an agent's rollout that failed every run)."""
    if meta.problem:
        return meta.problem
    if len(meta.samples) != group_size:
        return f"{len(meta.samples)} samples, want {group_size}"
    for s in meta.samples:
        missing = [k for k in token_keys if k not in s.lengths] + ([] if reward_key in s.scalars else [reward_key])
        if missing:
            return f"sample {s.uid} lacks {missing}"
        lengths = {s.lengths[k] for k in output_keys}
        if len(lengths) > 1:
            return f"sample {s.uid} has per-token arrays of different lengths {sorted(lengths)}"
    return None


def success_rate(meta: GroupMeta, reward_key: str) -> float:
    """The share of a group's answers that are correct: reward ≥ 1, as the `accuracy` metric counts."""
    return sum(s.scalars[reward_key] >= 1 for s in meta.samples) / len(meta.samples)


def outside_range(meta: GroupMeta, reward_key: str, bounds: list[float] | None) -> str | None:
    """Why dynamic filtering drops a scored group (its success rate is outside `bounds`), or None."""
    if bounds is None:
        return None
    rate = success_rate(meta, reward_key)
    low, high = bounds
    return None if low <= rate <= high else f"success rate {rate:.2f} outside [{low:g}, {high:g}]"


@dataclass
class FilterStreak:
    """The scored groups dynamic filtering has dropped in a row, none kept between them. A run
    whose every group scores alike (a model that cannot earn the reward, a task beyond it) would
    otherwise generate and drop groups until step_timeout; after `limit` in a row it stops, naming
    the filter and what the dropped groups scored (as veRL's DAPO stops at max_num_gen_batches)."""

    limit: int  # groups in a row that stop the run; 0 = never
    count: int = 0
    reward_sum: float = 0.0  # over the streak's answers
    correct: int = 0  # answers with reward >= 1 in the streak
    answers: int = 0

    def dropped(self, meta: GroupMeta, reward_key: str) -> None:
        self.count += 1
        rewards = [s.scalars[reward_key] for s in meta.samples]
        self.reward_sum += sum(rewards)
        self.correct += sum(r >= 1 for r in rewards)
        self.answers += len(rewards)

    def kept(self) -> None:
        self.count, self.reward_sum, self.correct, self.answers = 0, 0.0, 0, 0

    @property
    def stalled(self) -> bool:
        return bool(self.limit) and self.count >= self.limit

    def describe(self) -> str:
        return (f"mean reward {self.reward_sum / max(self.answers, 1):.3g}, "
                f"{self.correct} of {self.answers} answers correct (reward >= 1)")


@dataclass
class Intake:
    group_size: int
    n_ranks: int
    token_keys: list[str]  # per-token keys every sample carries (what the generate node writes)
    output_keys: list[str]  # those of them with one value per answer token; the first is the answer's ids
    prompt_key: str  # the key of the prompt's token ids
    reward_key: str  # the key the train node reads as its reward
    groups: dict[int, GroupMeta] = field(default_factory=dict)  # scored, not yet trained
    location: dict[int, int] = field(default_factory=dict)  # group id -> trainer rank holding it
    seen: set[int] = field(default_factory=set)  # every group id accepted or dropped
    dropped: int = 0

    def __len__(self) -> int:
        return len(self.groups)

    def tokens(self, group_id: int) -> int:
        """Prompt + answer tokens of a group: the trainer's work, what ranks are balanced on."""
        return sum(s.lengths[self.prompt_key] + s.lengths[self.output_keys[0]] for s in self.groups[group_id].samples)

    def load(self) -> list[int]:
        """Untrained tokens held by each rank."""
        load = [0] * self.n_ranks
        for g, rank in self.location.items():
            load[rank] += self.tokens(g)
        return load

    def accept(self, meta: GroupMeta) -> tuple[int, str | None]:
        """(rank that will hold the group, None), or (DROP, why) for a group that cannot be trained."""
        if meta.group_id in self.seen:
            return DROP, f"group {meta.group_id} arrived twice"
        self.seen.add(meta.group_id)
        problem = group_problem(meta, self.group_size, self.token_keys, self.output_keys, self.reward_key)
        if problem:
            self.dropped += 1
            return DROP, problem
        load = self.load()
        rank = load.index(min(load))
        self.groups[meta.group_id] = meta
        self.location[meta.group_id] = rank
        return rank, None

    def take(self, group_ids: list[int]) -> dict[int, tuple[GroupMeta, int, int]]:
        """Remove these groups: id -> (metadata, rank holding it, tokens)."""
        missing = [g for g in group_ids if g not in self.groups]
        if missing:
            raise KeyError(f"groups {missing} are not in the intake")
        taken = {g: (self.groups[g], self.location[g], self.tokens(g)) for g in group_ids}
        for g in group_ids:
            del self.groups[g], self.location[g]
        return taken
