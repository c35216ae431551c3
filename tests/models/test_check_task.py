"""The two-agent example's bootstrap (tiny_arith_check): a solver's problems and a checker's
claims, the claims right and wrong by halves, every checker trace's verdict true, and the checker's
reward reading the verdict as the agent does."""

from areal_flow.data import arith
from areal_flow.models.tasks import CHECK_SHARE, arith_check_pairs, bootstrap_task


def test_half_the_traces_check_claims_half_of_them_wrong_and_every_verdict_is_true():
    pairs = arith_check_pairs(0, (200, 0))
    drawn = [next(pairs) for _ in range(4000)]
    checks = [(p, c) for p, c in drawn if p.startswith("check ")]
    assert abs(len(checks) / len(drawn) - CHECK_SHARE) < 0.03
    wrong = 0
    for prompt, completion in checks:
        expr, _, claim = prompt.removeprefix("check ").strip().partition("=")
        a, b = arith.operands(expr + "=")
        right = int(claim) == a + b
        wrong += not right
        assert completion.startswith(arith.completion_text(a, b))  # the sum worked out as the solver works it
        assert arith.check_reward(completion, right) == 1.0 and arith.check_reward(completion, not right) == 0.0
        assert right or len(claim) == len(str(a + b))  # a slip of one digit, never a leading zero
    assert abs(wrong / len(checks) - 0.5) < 0.04
    held_out = {arith.prompt_text(a, b) for a, b in arith.heldout_problems(200, 0)}
    solver = [p for p, _ in drawn if not p.startswith("check ")]
    assert not held_out & set(solver)  # the held-out problems stay unseen
    assert bootstrap_task("tiny_arith_check").chars == bootstrap_task("tiny_arith_tool").chars
