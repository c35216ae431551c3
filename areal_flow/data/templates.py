"""Prompt templates: the text a row's prompt field holds when generation reads it.

`dataset.prompt_template` is a Python format string over the row's fields
(`"Question: {prompt}\\nAnswer:"`); `dataset.chat_template` wraps the prompt (after the format
string, when both are set) in the tokenizer's chat template as one user message with the
generation prompt. They are applied once, when the rows are loaded, so the rollout workers and
the held-out evaluation tokenise the same text.
"""

from __future__ import annotations

import string
from collections.abc import Sequence

from areal_flow.data.dataset import DatasetError


def template_fields(template: str, where: str = "dataset.prompt_template") -> list[str]:
    """The row fields a format string names, in order; `DatasetError` for a malformed one or one
    with positional fields (a row has only named fields), naming the key `where`."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise DatasetError(f"{where}: not a valid format string ({e}): {template!r}") from None
    names = []
    for _, name, _, _ in parsed:
        if name is None:
            continue
        # "{meta[k]}" and "{x.y}" read the field before the first index or attribute.
        root = name.split(".", 1)[0].split("[", 1)[0]
        if not root or root.isdigit():
            raise DatasetError(f"{where}: {{{name}}} is positional; name a row field, "
                               f"e.g. {{prompt}}: {template!r}")
        names.append(root)
    return list(dict.fromkeys(names))


def check_chat_template(tokenizer, model: str, key: str = "dataset.chat_template",
                        template: str = "a dataset.prompt_template") -> None:
    """`DatasetError` unless `tokenizer` has a chat template for `<key>=true`."""
    if not getattr(tokenizer, "chat_template", None):
        raise DatasetError(f"{key}=true, but the tokenizer of {model} has no chat template; "
                           f"set {key}=false (and {template} if the model "
                           "needs one) or use a model whose tokenizer has one")


def apply_templates(rows: Sequence[dict[str, str]], prompt_key: str, source: str, prompt_template: str | None = None,
                    chat_template: bool = False, tokenizer=None) -> list[dict[str, str]]:
    """`rows` with `prompt_key` replaced by the templated prompt (new dicts; the other fields as
    they were). With `chat_template` and no `tokenizer` only the format string is applied: the
    launcher checks the rows before the model exists. `source` names the dataset in errors."""
    if prompt_template is None and not (chat_template and tokenizer is not None):
        return list(rows)
    names = template_fields(prompt_template) if prompt_template is not None else []
    if chat_template and tokenizer is not None:
        check_chat_template(tokenizer, getattr(tokenizer, "name_or_path", "") or "this model")
    out = []
    for row in rows:
        text = row[prompt_key]
        if prompt_template is not None:
            for name in names:
                if name not in row:
                    raise DatasetError(f"{source}: row {row['id']!r} has no field {name!r}, which "
                                       f"dataset.prompt_template names (row has: {', '.join(row)})")
            try:
                text = prompt_template.format_map(row)
            except (IndexError, KeyError, AttributeError, TypeError, ValueError) as e:
                raise DatasetError(f"{source}: row {row['id']!r}: dataset.prompt_template "
                                   f"{prompt_template!r} fails ({type(e).__name__}: {e})") from None
        if chat_template and tokenizer is not None:
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                 add_generation_prompt=True, tokenize=False)
        out.append({**row, prompt_key: text})
    return out
