"""What a route raises to answer an error, shared by both dialects (SGLang's native API and
OpenAI's) and the HTTP plumbing that answers it."""

from __future__ import annotations

from typing import Any


class HTTPError(Exception):
    """Answer with this status and SGLang's `{"error": {"message": ...}}` envelope; `extra` adds
    fields to it (OpenAI's type, param and code: openai_api.py)."""

    def __init__(self, status: int, message: str, extra: dict | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.extra = extra or {}


def bad_request(message: str) -> HTTPError:
    return HTTPError(400, message)


def as_bool(value: Any, name: str, default: bool) -> bool:
    """A boolean field of a body: `default` when absent (null), else true or false (400 otherwise)."""
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be true or false, got {value!r}")
    return value
