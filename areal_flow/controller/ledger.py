"""`ledger.jsonl`: one line per admission, finish, drop and train of a prompt group, so that every
admitted group can be shown trained exactly once or accounted for."""

from __future__ import annotations

import time

import msgspec


class Ledger:
    def __init__(self, path: str):
        # Buffered, and flushed once per step by the controller (and on close): a line-buffered
        # file costs a write system call per event, ~20 per step, on the controller's CPU.
        self._file = open(path, "ab")
        self._encoder = msgspec.json.Encoder()

    def write(self, event: str, **fields) -> None:
        self._file.write(self._encoder.encode({"event": event, "time": time.time(), **fields}) + b"\n")

    def flush(self) -> None:
        self._file.flush()

    def tell(self) -> int:
        """The ledger's length in bytes, written events included."""
        self._file.flush()
        return self._file.tell()

    def close(self) -> None:
        self._file.close()


def audit(path: str, max_staleness: int) -> dict:
    """Check a run's ledger (across every resume: a resume cuts the ledger back to its checkpoint):
    every admitted prompt group is trained exactly once, or filtered or dropped exactly once by a
    named rule, or still pending (generating or buffered) at the end; every step trains once; no
    trained group's admission version lies more than `max_staleness` steps behind its step, and no
    answer token's version either (a `finish` event's `tokens`: version -> count; a token can be
    older than its group's admission only if a server decoded on weights older than it should).
    Returns the counts, `stale_tokens` (trained tokens more than `max_staleness` behind their step)
    and `problems`, a list of what is wrong (empty when the audit passes)."""
    events = [msgspec.json.decode(line) for line in open(path, "rb") if line.strip()]
    admitted: dict[int, int] = {}  # group -> version of its last admission (a resumed run admits again)
    finished, outcomes, steps = set(), {}, []
    tokens: dict[int, dict[str, int]] = {}  # group -> its answer tokens by version, as finished
    problems, stale_tokens = [], 0
    for e in events:
        kind = e["event"]
        if kind == "admit":
            admitted[e["group"]] = e["version"]
        elif kind == "finish":
            finished.add(e["group"])
            tokens[e["group"]] = e.get("tokens", {})
        elif kind in ("filter", "drop"):
            if e["group"] in outcomes:
                problems.append(f"group {e['group']}: {kind} after {outcomes[e['group']][0]}")
            outcomes[e["group"]] = (kind, e.get("reason", ""))
        elif kind == "train":
            steps.append(e["step"])
            for g in e["groups"]:
                if g in outcomes:
                    problems.append(f"group {g}: trained at step {e['step']} after {outcomes[g][0]}")
                elif g not in finished:
                    problems.append(f"group {g}: trained at step {e['step']} but never finished")
                elif e["step"] - admitted.get(g, e["step"]) > max_staleness:
                    problems.append(f"group {g}: admitted at version {admitted[g]}, trained at step {e['step']} "
                                    f"(staleness above {max_staleness})")
                stale = {int(v): n for v, n in tokens.get(g, {}).items() if e["step"] - int(v) > max_staleness}
                if stale and g not in outcomes:
                    stale_tokens += sum(stale.values())
                    problems.append(f"group {g}: trained at step {e['step']} with {sum(stale.values())} token(s) of "
                                    f"version {min(stale)} (realised staleness above {max_staleness})")
                outcomes[g] = ("train", e["step"])
    if steps != list(range(len(steps))):
        problems.append(f"steps trained out of order or twice: {steps}")
    unknown = sorted(set(outcomes) - set(admitted))
    if unknown:
        problems.append(f"groups {unknown[:10]} have an outcome but were never admitted")
    kinds = [kind for kind, _ in outcomes.values()]
    return {"admitted": len(admitted), "trained": kinds.count("train"), "filtered": kinds.count("filter"),
            "dropped": kinds.count("drop"), "pending": len(set(admitted) - set(outcomes)), "steps": len(steps),
            "resumes": sum(e["event"] == "resume" for e in events), "stale_tokens": stale_tokens,
            "scales": sum(e["event"] == "scale" for e in events),
            "problems": problems}
