"""The character-level tokenizers of the tiny tasks: the arithmetic task's 15 characters + 3
specials, and the code task's printable ASCII with a chat template.

Built with the `tokenizers` library (WordLevel over single characters, a pre-tokenizer that
isolates every character, a decoder that concatenates them) and wrapped in
`PreTrainedTokenizerFast`, so it saves and loads like any Hugging Face tokenizer.

Encoding adds no special tokens, even with `add_special_tokens=True` (the default): there is no
post-processor, so callers append `eos_token_id` themselves where a sequence should end.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

if TYPE_CHECKING:  # transformers is imported where a tokenizer is made: it takes a second, and the
    from transformers import (
        PreTrainedTokenizerFast,  # launcher reads only CHARS on every run
    )

CHARS = "0123456789+=;# "
# The code task's characters: a newline and printable ASCII (a tab is not one: indents are spaces).
CODE_CHARS = "\n" + "".join(chr(c) for c in range(32, 127))
PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
# Specials first so their ids (0, 1, 2) do not move if the character set ever grows.
SPECIALS = (PAD, EOS, UNK)
# The chat template's role markers (ChatML, as Qwen's), one token each, after the characters.
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
TOOLS_PREAMBLE = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
                  "with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_INSTRUCTION = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                     "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
                     "\"arguments\": <args-json-object>}\n</tool_call>")
CHAT_TEMPLATE = (
    # With tools, a system turn lists them first (its own content, if any, ahead), as Qwen2.5's template.
    "{% if tools %}" + IM_START + "system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}"
    "\n\n{% endif %}" + TOOLS_PREAMBLE + "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}"
    + TOOLS_INSTRUCTION + IM_END + "\n{% endif %}"
    "{% for m in messages %}{% if not (tools and loop.first and m['role'] == 'system') %}"
    "{% if m['role'] == 'tool' %}" + IM_START + "user\n<tool_response>\n{{ m['content'] }}\n</tool_response>"
    + IM_END + "\n{% else %}" + IM_START + "{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>\n{{ {'name': c['name'], 'arguments': c['arguments']} | tojson }}"
    "\n</tool_call>{% endfor %}" + IM_END + "\n{% endif %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}" + IM_START + "assistant\n{% endif %}")
"""ChatML over the character tokenizer: `<|im_start|>user\n...<|im_end|>\n<|im_start|>assistant\n`; tool
definitions, an assistant's `<tool_call>{json}</tool_call>` and tool results as Qwen2.5's template
writes them (the OpenAI endpoints: generation/http/openai_api.py)."""


def build_char_tokenizer(chars: str = CHARS, chat: bool = False, words: tuple[str, ...] = (),
                         eos: str = EOS) -> PreTrainedTokenizerFast:
    """A fresh tokenizer: ids 0-2 are `<pad> <eos> <unk>`, then `chars` in order; with `chat`, the
    two role markers and CHAT_TEMPLATE (the arithmetic task has neither); then `words`, strings
    of several characters that are one token each, written and read back as text (a tool call's
    tags, as Qwen's `<tool_call>`). `eos` is the token that ends an answer: IM_END for a model whose
    answers are chat turns (as Qwen's instruct models: the server stops there, the template ends
    the turn with it)."""
    if len(set(chars)) != len(chars) or len(set(words)) != len(words):
        raise ValueError("build_char_tokenizer: repeated characters or words")
    if eos not in (EOS, *((IM_END,) if chat else ())):
        raise ValueError(f"build_char_tokenizer: eos must be {EOS} or, with chat, {IM_END}; got {eos!r}")
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for c in chars:
        vocab[c] = len(vocab)
    markers = (IM_START, IM_END) if chat else ()
    for m in (*markers, *words):
        vocab[m] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Not special: a decode that skips special tokens (the reward's) still reads the tags.
    core.add_tokens([AddedToken(w, normalized=False) for w in words])
    # `[\s\S]` rather than `.`, which would leave a newline glued to nothing and unsplit.
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Fuse joins tokens with no separator; the default decoder would put spaces between them.
    core.decoder = decoders.Fuse()
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        eos_token=eos,
        unk_token=UNK,
        additional_special_tokens=list(markers),
        # The space is a real token ("#### 4690"); clean-up would strip spaces around digits.
        clean_up_tokenization_spaces=False,
    )
    if chat:
        tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
"""What `load_tokenizer` reads: the fast tokenizer itself, and its special tokens (eos, pad)."""


def missing_tokenizer_files(path: str) -> list[str]:
    """The files of TOKENIZER_FILES that the model directory `path` lacks."""
    return [name for name in TOKENIZER_FILES if not os.path.isfile(os.path.join(path, name))]


def load_tokenizer(path: str) -> PreTrainedTokenizerFast:
    """Load a tokenizer saved by `save_pretrained`.

    Not `AutoTokenizer`: beside a `qwen2` config.json it can rebuild a `Qwen2Tokenizer`, which
    drops the space in `"#### 4690"` and so breaks every answer.
    """
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(path)
