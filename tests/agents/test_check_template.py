"""The chat-template checker (agents/check_template.py): the project's templates keep an agent's
tokens; a template that rewrites history and a tokenizer that merges across a seam are caught,
named by conversation, call and position."""

from __future__ import annotations

import subprocess
import sys

import pytest
from tokenizers import Tokenizer, models, trainers
from transformers import PreTrainedTokenizerFast

from areal_flow.agents.check_template import CONVERSATIONS, check
from areal_flow.models.tokenizer import CHAT_TEMPLATE, CODE_CHARS, build_char_tokenizer


def test_the_project_chat_template_keeps_every_call_s_tokens():
    assert check(build_char_tokenizer(CODE_CHARS, chat=True)) == []


def test_a_template_that_rewrites_earlier_answers_is_caught():
    tokenizer = build_char_tokenizer(CODE_CHARS, chat=True)
    # As templates that drop earlier reasoning do: only the last assistant message is shown whole.
    tokenizer.chat_template = CHAT_TEMPLATE.replace(
        "{{ m['content'] }}", "{% if m['role'] == 'assistant' and not loop.last %}(earlier){% else %}"
                              "{{ m['content'] }}{% endif %}")
    drifts = check(tokenizer)
    assert {d.kind for d in drifts} == {"history rewritten"}
    two = next(d for d in drifts if d.conversation == "two turns")
    assert two.call == 1 and "(earlier)" in two.context


def test_a_tokenizer_that_merges_across_the_seam_is_caught():
    """A BPE over whole texts (no pre-tokenizer) learns merges like `\\n4`: the answer tokenized
    after its prompt differs from the conversation tokenized whole."""
    texts = [f"<|im_start|>assistant\n{n}<|im_end|>\n" for n in range(100)] * 20
    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.train_from_iterator(texts + [CODE_CHARS], trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<pad>", "<eos>", "<unk>"], show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", pad_token="<pad>",
                                        unk_token="<unk>")
    tokenizer.chat_template = CHAT_TEMPLATE
    drifts = check(tokenizer, {"two turns": CONVERSATIONS["two turns"]})
    assert drifts and drifts[0].kind == "tokens differ at the seam" and drifts[0].conversation == "two turns"


@pytest.mark.slow  # two interpreters that import transformers: 10 s
def test_the_command_exits_0_on_the_project_template_and_2_without_one(tmp_path):
    build_char_tokenizer(CODE_CHARS, chat=True).save_pretrained(tmp_path / "chat")
    build_char_tokenizer().save_pretrained(tmp_path / "plain")
    command = [sys.executable, "-m", "areal_flow.agents.check_template"]
    ok = subprocess.run([*command, str(tmp_path / "chat")], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "0 drifts" in ok.stdout, ok.stderr
    none = subprocess.run([*command, str(tmp_path / "plain")], capture_output=True, text=True, timeout=120)
    assert none.returncode == 2 and "no chat template" in none.stderr


MISTRAL_TEMPLATE = (
    # Mistral's alternation rule: no system turn, no tool turn.
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
    "{% else %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}")


def _saved(tmp_path, template: str | None) -> str:
    tokenizer = build_char_tokenizer(CODE_CHARS, chat=True)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(tmp_path / "tok")
    return str(tmp_path / "tok")


def _run(capsys, *argv: str) -> tuple[int, str, list[str]]:
    from areal_flow.agents.check_template import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err.splitlines()


@pytest.mark.parametrize("where", ["no-such-dir", "empty-dir"])
def test_a_path_with_no_tokenizer_is_one_line_and_exit_2(tmp_path, capsys, where):
    path = tmp_path / where
    if where == "empty-dir":
        path.mkdir()
    code, out, err = _run(capsys, str(path))
    assert code == 2 and out == "" and len(err) == 1, err
    assert err[0].startswith(f"{path}: cannot check: ") and "Repo id" not in err[0]
    assert ("no such directory" if where == "no-such-dir" else "no tokenizer files") in err[0]


def test_a_template_that_refuses_tool_turns_says_so_per_conversation_and_exits_2(tmp_path, capsys):
    code, out, err = _run(capsys, _saved(tmp_path, MISTRAL_TEMPLATE))
    refused = [name for name in CONVERSATIONS if name != "two turns"]  # system and tool turns
    assert code == 2 and len(err) == len(refused), err
    for name, line in zip(refused, err):
        assert f"cannot check {name!r}: the template refuses it: Conversation roles must alternate" in line
    assert "1 conversations (3 refused by the template), 2 calls, 0 drifts" in out and "drift:" not in out


def test_drift_in_the_conversations_a_template_renders_is_still_exit_1(tmp_path, capsys):
    # Earlier answers rewritten, as in test_a_template_that_rewrites_earlier_answers_is_caught.
    rewriting = MISTRAL_TEMPLATE.replace("{{ m['content'] + eos_token }}",
                                         "{% if loop.last %}{{ m['content'] }}{% else %}(earlier){% endif %}")
    code, out, err = _run(capsys, _saved(tmp_path, rewriting))
    assert code == 1 and "drift: two turns, call 1: history rewritten" in out and len(err) == 3


def test_the_help_documents_the_exit_statuses(capsys):
    from areal_flow.agents.check_template import main

    with pytest.raises(SystemExit) as done:
        main(["--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0
    assert "0  checked: no drift" in out and "1  drift" in out and "2  cannot check" in out
