"""Tool calls out of a model's answer, in the formats model families write them: pure functions
from the answer's text to (the content before the calls, the calls), or None when the text holds no
well-formed call (the answer is then plain text).

- `hermes` (Hermes, Qwen2.5, Qwen3): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
  blocks, any text before them the content.
- `llama3` (Llama-3.1/3.2/3.3 JSON): the answer is `{"name": ..., "parameters": {...}}` ("arguments"
  too), optionally after `<|python_tag|>` (the content before it), several separated by `;`.
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or the newer
  `[TOOL_CALLS]name[ARGS]{...}` (one `[TOOL_CALLS]` per call).
- `pythonic` (Llama-3.2/4 pythonic): `[f(x=1, y="a"), g()]`, read with Python's `ast` as literals
  only: nothing of the answer is ever evaluated.

A call is `{"name": str, "arguments": str}`, the arguments a JSON object's text. Arguments that are
not an object (a list, a number, text that is not JSON) make the answer plain text, as OpenAI's
`arguments` is always an object's JSON. The names are SGLang's `--tool-call-parser` names (hermes,
llama3, mistral, pythonic; `qwen25`/`qwen` and vLLM's `llama3_json` are accepted as aliases), and
`auto` picks one from the model's chat template (`for_template`).

Special tokens: a server that decodes with `skip_special_tokens` drops `<|python_tag|>` and
`[TOOL_CALLS]` from the text where the tokenizer marks them special, so `llama3` and `mistral` also
read an answer that is only the calls' JSON without its marker.
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

Parsed = tuple[str | None, list[dict]]
"""(content before the calls or None, the calls [{"name", "arguments"}])."""

SGLANG_NAMES = {"hermes": "qwen25", "llama3": "llama3", "mistral": "mistral", "pythonic": "pythonic"}
"""Each parser's SGLang `--tool-call-parser` name. `qwen25` rather than `hermes`: SGLang parses the
same `<tool_call>` blocks with both, and only recent versions know `hermes`."""

ALIASES = {"qwen25": "hermes", "qwen": "hermes", "llama3_json": "llama3", "llama4_pythonic": "pythonic"}
"""Other names of the parsers (SGLang's and vLLM's)."""

NAMES = ("auto", *SGLANG_NAMES, *ALIASES)
"""What `generation.tool_call_parser` and `--tool-call-parser` accept."""

KEY = "generation.tool_call_parser"

_DECODER = json.JSONDecoder()
_WS = " \t\r\n"
_PYTHONIC_TRIES = 16  # answer lines starting with `[` tried as the call list: bounds the work on long text


def _json_at(text: str, pos: int) -> tuple[Any, int] | None:
    """The JSON value starting at `pos` (after whitespace) and where it ends, or None. A value
    nested deeper than Python's parser recurses is not JSON here (RecursionError)."""
    while pos < len(text) and text[pos] in _WS:
        pos += 1
    try:
        return _DECODER.raw_decode(text, pos)
    except (ValueError, RecursionError):
        return None


def _skip(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WS:
        pos += 1
    return pos


def _arguments(value: Any) -> str | None:
    """OpenAI's `arguments` (an object's JSON text) of a call's arguments, or None when they are
    not an object: a dict, or a string holding one (some models write the arguments as a string)."""
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, str):
        try:
            return value if isinstance(json.loads(value), dict) else None
        except (ValueError, RecursionError):
            return None
    return None


def _call(obj: Any, keys: tuple[str, ...] = ("arguments", "parameters"), need_arguments: bool = False) -> dict | None:
    """{"name", "arguments"} of a decoded JSON call, or None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = next((k for k in keys if k in obj), None)
    if key is None and need_arguments:
        return None
    arguments = "{}" if key is None else _arguments(obj[key])
    return None if arguments is None else {"name": obj["name"], "arguments": arguments}


def _content(text: str) -> str | None:
    return text.strip() or None


def parse_hermes(text: str) -> Parsed | None:
    """`<tool_call>{json}</tool_call>` blocks. Each block's JSON is decoded where it starts, so a
    `</tool_call>` inside an argument's string does not end it; the last block may lack its closing
    tag when the answer ends there. Text between and after the blocks is dropped (as SGLang's)."""
    start = text.find("<tool_call>")
    if start < 0:
        return None
    calls, pos = [], start
    while (pos := text.find("<tool_call>", pos)) >= 0:
        got = _json_at(text, pos + len("<tool_call>"))
        if got is None or (call := _call(got[0])) is None:
            return None
        pos = _skip(text, got[1])
        if text.startswith("</tool_call>", pos):
            pos += len("</tool_call>")
        elif pos < len(text):
            return None  # the block goes on after its JSON
        calls.append(call)
    return _content(text[:start]), calls


def _json_calls(text: str, pos: int, separator: str, need_arguments: bool) -> tuple[list[dict], int] | None:
    """A JSON array of calls, or JSON call objects separated by `separator`, from `pos`; and where
    they end."""
    got = _json_at(text, pos)
    if got is None:
        return None
    value, pos = got
    if isinstance(value, list):
        calls = [_call(item, need_arguments=need_arguments) for item in value]
        return (calls, pos) if calls and None not in calls else None
    calls = []
    while True:
        call = _call(value, need_arguments=need_arguments)
        if call is None:
            return None
        calls.append(call)
        after = _skip(text, pos)
        if not separator or not text.startswith(separator, after):
            return calls, pos
        if (got := _json_at(text, after + len(separator))) is None:
            return None
        value, pos = got


def parse_llama3(text: str) -> Parsed | None:
    """Llama 3's JSON calls: the answer (after `<|python_tag|>`, when there is one) is a call object
    with `name` and `parameters` (or `arguments`), several joined by `;`, or an array of them. The
    arguments key is required: a plain JSON answer with a `name` field is not a call."""
    tag = text.find("<|python_tag|>")
    content, body = (None, text) if tag < 0 else (_content(text[:tag]), text[tag + len("<|python_tag|>"):])
    pos = _skip(body, 0)
    if not body.startswith(("{", "["), pos):
        return None
    got = _json_calls(body, pos, ";", need_arguments=True)
    if got is None or _skip(body, got[1]) < len(body):
        return None  # not JSON, or text after the calls: an answer, not calls
    return content, got[0]


_MISTRAL_NAME = re.compile(r"\s*([A-Za-z0-9_.\-]+)\s*(?:\[CALL_ID\]\s*[A-Za-z0-9]+\s*)?\[ARGS\]")


def parse_mistral(text: str) -> Parsed | None:
    """`[TOOL_CALLS]` then a JSON array of calls, or `name[ARGS]{json}` once per `[TOOL_CALLS]`
    (Mistral's v11+ tokenizers; `[CALL_ID]id` before `[ARGS]` too). Without the marker (dropped as
    a special token), an answer that is only a JSON array of calls."""
    marker = text.find("[TOOL_CALLS]")
    if marker < 0:
        pos = _skip(text, 0)
        got = _json_calls(text, pos, "", need_arguments=True) if text.startswith("[", pos) else None
        return None if got is None or _skip(text, got[1]) < len(text) else (None, got[0])
    content, calls, pos = _content(text[:marker]), [], marker
    while text.startswith("[TOOL_CALLS]", pos):
        pos += len("[TOOL_CALLS]")
        if text.startswith("[", _skip(text, pos)):
            got = _json_calls(text, pos, "", need_arguments=False)
            if got is None:
                return None
            calls += got[0]
            pos = got[1]
        else:
            named = _MISTRAL_NAME.match(text, pos)
            got = None if named is None else _json_at(text, named.end())
            arguments = None if got is None else _arguments(got[0])
            if arguments is None:
                return None
            calls.append({"name": named.group(1), "arguments": arguments})
            pos = got[1]
        pos = _skip(text, pos)
    return content, calls  # text after the last call is dropped, as after hermes' blocks


class _NotLiteral(ValueError):
    """A call's argument that is not a literal: a name, a call, an operation."""


def _literal(node: ast.AST) -> Any:
    """The JSON value of a literal expression (a constant, a list, tuple or dict of literals, a
    signed number); _NotLiteral for anything that would need evaluating."""
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, bool, int, float))):
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise _NotLiteral("not a JSON number")
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(item) for item in node.elts]
    if isinstance(node, ast.Dict):
        keys = [_literal(k) if k is not None else None for k in node.keys]
        if not all(isinstance(k, str) for k in keys):
            raise _NotLiteral("a dict key that is not a string")
        return dict(zip(keys, (_literal(v) for v in node.values)))
    if (isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd))
            and isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float)):
        value = _literal(node.operand)  # finite
        return -value if isinstance(node.op, ast.USub) else value
    raise _NotLiteral(type(node).__name__)


def _pythonic_calls(source: str) -> list[dict] | None:
    """The calls of `[f(x=1), g()]`, or None: not a list of calls by name with keyword literals."""
    tree = ast.parse(source, mode="eval")  # parses only: nothing runs
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        if any(k.arg is None for k in node.keywords):  # **kwargs
            return None
        arguments = {k.arg: _literal(k.value) for k in node.keywords}
        calls.append({"name": node.func.id, "arguments": json.dumps(arguments, ensure_ascii=False)})
    return calls


def parse_pythonic(text: str) -> Parsed | None:
    """A Python list of calls with keyword literal arguments, `[f(x=1, y="a"), g()]` (Llama 4's
    `<|python_start|>`/`<|python_end|>` around it too), ending the answer; text before it, on lines
    of its own, is the content. Read with `ast.parse`, values taken from literal nodes only:
    `[f(x=__import__('os').system('id'))]` is not a call but text."""
    body = text.replace("<|python_start|>", "\n").replace("<|python_end|>", "").rstrip()
    if not body.endswith("]"):
        return None
    starts = [m.start() for m in re.finditer(r"(?:^|(?<=\n))[ \t]*\[", body)][:_PYTHONIC_TRIES]
    for start in starts:
        try:
            calls = _pythonic_calls(body[start:].strip())
        except SyntaxError:
            continue  # not where the list starts: the next line that opens a bracket may be
        except (_NotLiteral, ValueError, RecursionError, MemoryError):
            return None  # the list, but not of literal calls (or too deep to read)
        return None if calls is None else (_content(body[:start]), calls)
    return None


PARSERS: dict[str, Callable[[str], Parsed | None]] = {
    "hermes": parse_hermes, "llama3": parse_llama3, "mistral": parse_mistral, "pythonic": parse_pythonic}


def for_template(template: str | None) -> str:
    """The parser a chat template's text asks for: the format its tool instructions and its
    rendering of an assistant's calls use. Hermes when it says nothing recognisable (the
    project's own templates are Qwen's)."""
    text = template or ""
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "<tool_call>" in text:
        return "hermes"
    if "[func_name1(" in text or "params_name1=" in text or "<|python_start|>" in text:
        return "pythonic"
    if "<|python_tag|>" in text or '"parameters"' in text:
        return "llama3"
    return "hermes"


def resolve(name: str, template: str | None = None, key: str = KEY) -> str:
    """The parser `name` means (aliases followed; `auto`: the one `template` asks for). ValueError
    naming `key` for a name that is none of NAMES."""
    if name == "auto":
        return for_template(template)
    name = ALIASES.get(name, name)
    if name not in PARSERS:
        raise ValueError(f"{key}={name!r} is not a tool-call parser: one of {', '.join(NAMES)}")
    return name


def parse(name: str, text: str) -> Parsed | None:
    """The calls in `text` by the parser `name` (resolved: no `auto`)."""
    return PARSERS[ALIASES.get(name, name)](text)


def template_of(model_path: str) -> str | None:
    """The chat template text of a model directory (tokenizer_config.json's `chat_template`, one
    or a list of named ones, or chat_template.jinja), for `auto` where no tokenizer is loaded (the
    SGLang command line); None when it has none that can be read."""
    texts = []
    config = Path(model_path) / "tokenizer_config.json"
    try:
        template = json.loads(config.read_text()).get("chat_template") if config.is_file() else None
    except (OSError, ValueError):
        template = None
    if isinstance(template, str):
        texts.append(template)
    elif isinstance(template, list):
        texts += [t.get("template", "") for t in template if isinstance(t, dict)]
    jinja = Path(model_path) / "chat_template.jinja"
    try:
        texts += [jinja.read_text()] if jinja.is_file() else []
    except OSError:
        pass
    return "\n".join(t for t in texts if isinstance(t, str)) or None
