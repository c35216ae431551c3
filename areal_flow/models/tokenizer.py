"""The character-level tokenizer of the tiny arithmetic task: 15 characters + 3 specials.

Built with the `tokenizers` library (WordLevel over single characters, a pre-tokenizer that
isolates every character, a decoder that concatenates them) and wrapped in
`PreTrainedTokenizerFast`, so it saves and loads like any Hugging Face tokenizer.

Encoding adds no special tokens, even with `add_special_tokens=True` (the default): there is no
post-processor, so callers append `eos_token_id` themselves where a sequence should end.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

if TYPE_CHECKING:  # transformers is imported where a tokenizer is made: it takes a second, and the
    from transformers import (
        PreTrainedTokenizerFast,  # launcher reads only CHARS on every run
    )

CHARS = "0123456789+=;# "
PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
# Specials first so their ids (0, 1, 2) do not move if the character set ever grows.
SPECIALS = (PAD, EOS, UNK)


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """A fresh tokenizer: ids 0-2 are `<pad> <eos> <unk>`, then the 15 characters in order."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for c in CHARS:
        vocab[c] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # `[\s\S]` rather than `.`, which would leave a newline glued to nothing and unsplit.
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Fuse joins tokens with no separator; the default decoder would put spaces between them.
    core.decoder = decoders.Fuse()
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        # The space is a real token ("#### 4690"); clean-up would strip spaces around digits.
        clean_up_tokenization_spaces=False,
    )


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
