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
