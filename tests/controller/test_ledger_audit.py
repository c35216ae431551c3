"""The ledger audit finds a group trained twice, lost, or too stale, and passes a clean ledger."""

from areal_flow.controller.ledger import Ledger, audit


def ledger(tmp_path, *events, name="ledger.jsonl"):
    path = tmp_path / name
    led = Ledger(str(path))
    for kind, fields in events:
        led.write(kind, **fields)
    led.close()
    return str(path)


CLEAN = [("admit", {"group": 0, "version": 0}), ("admit", {"group": 1, "version": 0}),
         ("admit", {"group": 2, "version": 0}), ("finish", {"group": 0}), ("filter", {"group": 1, "reason": "x"}),
         ("train", {"step": 0, "groups": [0]}), ("admit", {"group": 3, "version": 1})]


def test_a_clean_ledger_passes_with_every_group_accounted(tmp_path):
    result = audit(ledger(tmp_path, *CLEAN), max_staleness=0)
    assert result == {"admitted": 4, "trained": 1, "filtered": 1, "dropped": 0, "pending": 2, "steps": 1,
                      "resumes": 0, "stale_tokens": 0, "scales": 0, "problems": []}


def test_a_group_trained_twice_or_after_a_filter_is_found(tmp_path):
    path = ledger(tmp_path, *CLEAN, ("finish", {"group": 2}), ("train", {"step": 1, "groups": [0, 1]}))
    problems = audit(path, max_staleness=2)["problems"]
    assert "group 0: trained at step 1 after train" in problems[0]
    assert "group 1: trained at step 1 after filter" in problems[1]


def test_a_step_trained_twice_and_an_unfinished_group_are_found(tmp_path):
    path = ledger(tmp_path, *CLEAN, ("train", {"step": 0, "groups": [2]}))
    problems = audit(path, max_staleness=2)["problems"]
    assert problems == ["group 2: trained at step 0 but never finished", "steps trained out of order or twice: [0, 0]"]


def test_staleness_counts_from_the_last_admission(tmp_path):
    events = [("admit", {"group": 0, "version": 0}), ("finish", {"group": 0}), ("train", {"step": 0, "groups": []}),
              ("train", {"step": 1, "groups": []}), ("train", {"step": 2, "groups": [0]})]
    assert "staleness above 1" in audit(ledger(tmp_path, *events), max_staleness=1)["problems"][0]
    readmitted = events[:1] + [("admit", {"group": 0, "version": 2, "resumed": True})] + events[1:]
    assert audit(ledger(tmp_path, *readmitted, name="again.jsonl"), max_staleness=1)["problems"] == []


def test_tokens_older_than_eta_are_found_though_their_group_was_admitted_in_time(tmp_path):
    # Admitted at version 2 and trained at step 3 (η = 1 holds for the admission), but 4 of its
    # tokens came from version 1: a server decoded on older weights than the admission's.
    events = [("admit", {"group": 0, "version": 2}), ("finish", {"group": 0, "tokens": {"1": 4, "2": 30, "3": 6}}),
              *[("train", {"step": s, "groups": []}) for s in range(3)], ("train", {"step": 3, "groups": [0]})]
    result = audit(ledger(tmp_path, *events), max_staleness=1)
    assert result["problems"] == ["group 0: trained at step 3 with 4 token(s) of version 1 (realised staleness above 1)"]
    assert result["stale_tokens"] == 4
    assert audit(ledger(tmp_path, *events, name="eta2.jsonl"), max_staleness=2)["problems"] == []
