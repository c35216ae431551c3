"""`resolve_named`, the one resolver of "a built-in's word or 'package.module:function'" behind
losses, reward functions, environments and agents."""

import pytest

from areal_flow.config.import_path import resolve_named

BUILTINS = {"exact": len, "os:getcwd": max}  # a built-in's name is looked up first, colon or not


def unknown() -> str:
    return "graph.reward.fn: no such function"


def test_a_builtin_is_found_by_its_word_before_any_import():
    assert resolve_named("exact", BUILTINS, where="k", unknown=unknown) is len
    assert resolve_named("os:getcwd", BUILTINS, where="k", unknown=unknown) is max
    assert resolve_named("os.path:join", BUILTINS, where="k", unknown=unknown).__name__ == "join"


def test_a_word_that_is_no_builtin_gets_the_callers_message_built_only_then():
    built = []

    def counted() -> str:
        built.append(1)
        return unknown()

    resolve_named("exact", BUILTINS, where="k", unknown=counted)
    assert built == []
    with pytest.raises(ValueError, match=r"^graph.reward.fn: no such function$"):
        resolve_named("exactly", BUILTINS, where="k", unknown=counted)
    assert built == [1]


@pytest.mark.parametrize("name, message", [
    ("no_such_module_q:f", r"^graph.env: cannot import 'no_such_module_q' \(No module named 'no_such_module_q'\)$"),
    ("os:no_such_attr", r"^graph.env: 'os' has no callable 'no_such_attr'$"),
    ("os:", r"^graph.env: expected 'module:function'$"),
])
def test_an_import_path_that_does_not_resolve_says_why_after_the_callers_words(name, message):
    with pytest.raises(ValueError, match=message):
        resolve_named(name, {}, where="graph.env", unknown=unknown)
