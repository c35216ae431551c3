"""Weight versions as generation servers label them: a label as a number, an answer's version, and
the version of each of its tokens (areal_flow's engine reports one a token; SGLang spans, or one
for the whole answer)."""

from __future__ import annotations


def version_number(label: object) -> int:
    """A weight version label as a number; one that is none (SGLang's first, "default") is 0."""
    try:
        return int(label)
    except (TypeError, ValueError):
        return 0


def token_versions(meta: dict, n: int) -> list[int]:
    """The weight version of each of an answer's n tokens: areal_flow's `output_token_versions`;
    else SGLang's `weight_versions` spans (0.5.23: a retracted answer spans several); else its
    `weight_version`, for every token (older SGLang). A label that is no number counts as 0
    (SGLang's initial label is "default"; areal_flow's runs label versions by number)."""
    if (versions := meta.get("output_token_versions")) is not None:
        return list(versions)
    out = [version_number(meta.get("weight_version"))] * n
    for span in meta.get("weight_versions") or ():
        out[span["start"]:span["end"]] = [version_number(span["version"])] * (span["end"] - span["start"])
    return out


def answer_version(answer: dict | list) -> int:
    """The weight version an answer (or the last of a group's answers) came from."""
    last = answer[-1] if isinstance(answer, list) and answer else answer
    return version_number(last.get("meta_info", {}).get("weight_version")) if isinstance(last, dict) else -1
