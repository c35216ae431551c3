"""OpenAI's wire format in front of the embedded engine: `/v1/models`, `/v1/completions` and
`/v1/chat/completions` (bodies, answers and errors as OpenAI's, so the `openai` client works
unchanged).

A chat request is rendered through the model's chat template (tokenizer_config.json), tool
definitions included; with `tools`, an answer holding calls in the model family's format (the
server's tool-call parser, generation/tool_parsers.py: Hermes/Qwen `<tool_call>` blocks, Llama 3's
JSON, Mistral's `[TOOL_CALLS]`, pythonic lists) comes back as `tool_calls` with finish_reason
`tool_calls`, and one whose calls do not parse comes back as plain text with finish_reason
`stop`. Every choice also carries the exact tokens, as SGLang's and vLLM's OpenAI endpoints can:
`token_ids` (the answer's), `output_token_logprobs` (each token's logprob under the sampling
temperature) and `output_token_versions` (the weight version that made it), and the answer
`prompt_token_ids`: what an RL trainer needs, with no re-tokenization. Streaming (`stream: true`) sends OpenAI's chunks as
server-sent events, the extension fields in each choice's last chunk; with `tools` a choice's text
is held back until it ends (whether it is a call is known only then).

This module reads the requests; openai_answers.py writes the answers.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError, TemplateSyntaxError

from areal_flow.generation.engine.generation_engine import GenerationRequest
from areal_flow.generation.engine.sampling import SamplingParams
from areal_flow.generation.http.errors import HTTPError

MAX_N = 64  # choices a request may ask for
MAX_STOP = 4  # stop strings, as OpenAI
COMPLETION_MAX_TOKENS = 16  # /v1/completions' default max_tokens, as OpenAI
ROLES = ("system", "user", "assistant", "tool")
# Fields a client may send that change nothing here; any other unknown field is refused.
IGNORED = frozenset({"user", "store", "metadata", "service_tier"})
UNSUPPORTED_UNLESS_ZERO = ("presence_penalty", "frequency_penalty")  # OpenAI's default 0 is accepted
SEEDS = (-(2**63), 2**64 - 1)  # a seed fits in 64 bits, signed or not (the engine draws from it mod 2^64)


def openai_error(status: int, message: str, param: str | None = None, code: str | None = None) -> HTTPError:
    """An HTTPError answered in OpenAI's envelope: message, type, param, code."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return HTTPError(status, message, extra={"type": kind, "param": param, "code": code})


@dataclass(frozen=True)
class OpenAICall:
    """What a /v1 request asks the engine for, and how to answer it."""

    chat: bool
    model: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    n: int
    stream: bool
    logprobs: int | None  # top alternatives per token to report (0: the chosen token only); None: none
    tools: bool  # parse tool calls out of the answers
    echo_usage: bool  # stream_options.include_usage
    skip_special_tokens: bool = True  # leave special tokens out of the text (vLLM's and SGLang's field)
    tool_parser: str = "hermes"  # the format of the model's calls (generation/tool_parsers.py)
    tool_name: str | None = None  # tool_choice named this function: only calls to it count
    parallel_tool_calls: bool = True  # false: the first call only

    def requests(self) -> list[GenerationRequest]:
        """The call's n engine requests (one prompt, shared by the engine's prefill); with a
        seed, choice i draws from seed + i, so that the choices differ and each is reproducible."""
        out = []
        for i in range(self.n):
            seed = None if self.params.seed is None else self.params.seed + i
            if seed is not None and seed > SEEDS[1]:
                seed -= 2**64  # wrapped to 64 bits, as /generate's sample j of n
            out.append(GenerationRequest(self.prompt_ids, dataclasses.replace(self.params, seed=seed),
                                         top_logprobs_num=self.logprobs or 0))
        return out


def served_models(model_path: str) -> list[str]:
    """The names a request may give as `model`: the path the server loaded, and its last part."""
    return [model_path, os.path.basename(os.path.normpath(model_path))]


def list_models(model_path: str, context_length: int | None, created: int) -> dict:
    return {"object": "list", "data": [{"id": model_path, "object": "model", "created": created,
                                        "owned_by": "areal_flow", "root": model_path,
                                        "max_model_len": context_length}]}


# ---- parsing -------------------------------------------------------------------------------------


def parse_call(body: Any, *, chat: bool, model_path: str, tokenizer: Any, context_length: int | None,
               known: frozenset[str], kv_budget: int | None = None, vocab_size: int | None = None,
               tool_parser: str = "hermes") -> OpenAICall:
    """A /v1/chat/completions (`chat`) or /v1/completions body, checked field by field: a 400 (404
    for an unknown model) naming the field. The prompt is rendered and tokenized last, once every
    other field is known to be good. `kv_budget` (the server's max_total_tokens) and `vocab_size`
    bound an answer's tokens and the alternatives per token, as the engine would; `tool_parser`
    (the server's, resolved) reads the answers' tool calls."""
    if not isinstance(body, dict):
        raise openai_error(400, "the request body must be a JSON object")
    for key, value in body.items():
        if key in UNSUPPORTED_UNLESS_ZERO:
            if value not in (None, 0):
                raise openai_error(400, f"{key} is not supported by the embedded engine (only 0)", key)
        elif key not in known and key not in IGNORED:
            raise openai_error(400, f"Unrecognized request argument supplied: {key}", key)
    model = body.get("model")
    if not isinstance(model, str):
        raise openai_error(400, "you must provide a model parameter", "model")
    if model not in served_models(model_path):
        raise openai_error(404, f"The model `{model}` does not exist.", "model", "model_not_found")
    alternatives = 20 if vocab_size is None else min(20, vocab_size)  # OpenAI's most, or the vocabulary
    if chat:
        max_key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        max_tokens = body.get(max_key)
        logprobs = _number(body, "top_logprobs", int, 0, 0, alternatives) if _bool(body, "logprobs", False) else None
        tools = _tools(body.get("tools"))
        tooling = tool_settings(body, tools, tool_parser)
    else:
        max_key, max_tokens = "max_tokens", body.get("max_tokens", COMPLETION_MAX_TOKENS)
        logprobs = _number(body, "logprobs", int, None, 0, min(5, alternatives))
        tools, tooling = [], {"tools": False}
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise openai_error(400, f"{max_key} must be a positive integer, got {max_tokens!r}", max_key)
    stop = _stop(body.get("stop"))
    if stop and tokenizer is None:
        raise openai_error(400, "stop strings need the model's tokenizer, and this server has none: send no stop",
                           "stop")
    temperature = _number(body, "temperature", float, 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", float, 1.0, 0.0, 1.0) or 1.0
    seed = _number(body, "seed", int, None, *SEEDS)
    n, stream = _number(body, "n", int, 1, 1, MAX_N), _bool(body, "stream", False)
    skip_special_tokens = _bool(body, "skip_special_tokens", True)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise openai_error(400, "stream_options must be an object", "stream_options")
    if chat and body.get("prompt_token_ids") is not None:
        # The conversation's tokens as the agent gateway mapped them (agents/chat_map.py): the
        # messages are checked, not rendered again.
        _messages(body.get("messages"))
        prompt = _token_ids(body["prompt_token_ids"], "prompt_token_ids")
    elif chat:
        text = render_chat(tokenizer, _messages(body.get("messages")), tools)
        prompt = tuple(tokenizer.encode(text, add_special_tokens=False))
    else:
        prompt = _prompt(body.get("prompt"), tokenizer)
    prompt_key = "messages" if chat else "prompt"
    if not prompt:
        raise openai_error(400, "the prompt is empty", prompt_key)
    max_tokens = _answer_tokens(max_tokens, max_key, len(prompt), prompt_key, context_length, kv_budget)
    params = SamplingParams(max_new_tokens=max_tokens, temperature=temperature, top_p=top_p, stop=stop, seed=seed)
    return OpenAICall(chat=chat, model=model, prompt_ids=prompt, params=params, n=n, stream=stream,
                      logprobs=logprobs, echo_usage=bool(options.get("include_usage")),
                      skip_special_tokens=skip_special_tokens, **tooling)


def tool_settings(body: dict, tools: list[dict], parser: str) -> dict[str, Any]:
    """OpenAICall's tool fields of a chat body with these (checked) `tools`: whether answers are
    read for calls, by which parser, only calls to a named function (`tool_choice`), only the
    first (`parallel_tool_calls: false`). `tool_choice: required` or a named function are not
    enforced while sampling (the engine has no constrained decoding): an answer without such a
    call stays text with finish_reason `stop`, as vLLM's and SGLang's answers without a grammar.
    A 400 naming the field when it is malformed or names no tool of `tools`."""
    choice, parallel = body.get("tool_choice"), body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise openai_error(400, f"parallel_tool_calls must be true or false, got {parallel!r}", "parallel_tool_calls")
    name = None
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if choice.get("type") == "function" and isinstance(function, dict) else None
        if not isinstance(name, str):
            raise openai_error(400, "tool_choice must be auto, none, required or {\"type\": \"function\", "
                                    "\"function\": {\"name\": ...}}", "tool_choice")
    elif choice not in (None, "auto", "none", "required"):
        raise openai_error(400, f"tool_choice must be auto, none, required or a function, got {choice!r}",
                           "tool_choice")
    if (name is not None or choice == "required") and not tools:
        raise openai_error(400, "tool_choice requires tools: the request lists none", "tool_choice")
    if name is not None and name not in {t["function"]["name"] for t in tools}:
        raise openai_error(400, f"tool_choice names the function {name!r}, which is not one of the request's "
                                "tools", "tool_choice")
    return {"tools": bool(tools) and choice != "none", "tool_parser": parser, "tool_name": name,
            "parallel_tool_calls": parallel is not False}


def _answer_tokens(asked: int | None, key: str, prompt_len: int, prompt_key: str, context_length: int | None,
                   kv_budget: int | None) -> int:
    """The answer's most tokens: `asked`, or (None) what is left of the model's context, or of the
    server's KV cache budget when smaller. A 400 naming the prompt when it leaves no room for one
    token, naming `key` when `asked` is more than the room."""
    limits = [(n, what) for n, what in ((context_length, "the model's context"),
                                        (kv_budget, "the server's KV cache budget (max_total_tokens)"))
              if n is not None]
    if not limits:
        if asked is None:
            raise openai_error(400, f"{key} is required: the model declares no context length", key)
        return asked
    limit, what = min(limits)
    room = limit - prompt_len
    if room < 1:
        raise openai_error(400, f"the prompt is {prompt_len} tokens and {what} is {limit} tokens: no room for an "
                                f"answer; shorten the {prompt_key}", prompt_key, "context_length_exceeded")
    if asked is not None and asked > room:
        raise openai_error(400, f"{key}={asked} with a prompt of {prompt_len} tokens is over {what} of {limit} "
                                f"tokens: at most {room}", key, "context_length_exceeded")
    return room if asked is None else asked


def _bool(body: dict, key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise openai_error(400, f"{key} must be true or false, got {value!r}", key)
    return value


def _number(body: dict, key: str, kind: type, default: Any, low: Any, high: Any) -> Any:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise openai_error(400, f"{key} must be {'a number' if kind is float else 'an integer'}, got {value!r}", key)
    if kind is float and not math.isfinite(value):  # Python's json reads NaN and Infinity
        raise openai_error(400, f"{key} must be a finite number, got {value!r}", key)
    if (low is not None and value < low) or (high is not None and value > high):
        raise openai_error(400, f"{key}={value!r} must be in [{low}, {high}]", key)
    return kind(value)


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOP:
        raise openai_error(400, f"stop must be a non-empty string or a list of at most {MAX_STOP} of them, "
                                f"got {value!r}", "stop")
    return tuple(stops)


def _prompt(value: Any, tokenizer: Any) -> tuple[int, ...]:
    """/v1/completions' prompt: a string, or a list of token ids (one prompt per request here)."""
    if isinstance(value, str):
        if tokenizer is None:
            raise openai_error(400, "a text prompt needs the model's tokenizer; send token ids", "prompt")
        return tuple(tokenizer.encode(value, add_special_tokens=False))
    if _is_token_ids(value):
        return tuple(value)
    raise openai_error(400, "prompt must be a string or a list of token ids (one prompt a request)", "prompt")


def _token_ids(value: Any, key: str) -> tuple[int, ...]:
    if _is_token_ids(value):
        return tuple(value)
    raise openai_error(400, f"{key} must be a list of token ids", key)


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _messages(value: Any) -> list[dict]:
    """The messages, checked (role, content shape), with content parts joined into one string."""
    if not isinstance(value, list) or not value:
        raise openai_error(400, "messages must be a non-empty list", "messages")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise openai_error(400, f"{where} must be an object", where)
        role = message.get("role")
        if role not in ROLES:
            raise openai_error(400, f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", f"{where}.role")
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise openai_error(400, f"{where}.content parts must be text parts", f"{where}.content")
            content = "".join(p["text"] for p in content)
        calls = message.get("tool_calls")
        if content is None and not (role == "assistant" and calls):
            raise openai_error(400, f"{where}.content is required", f"{where}.content")
        if content is not None and not isinstance(content, str):
            raise openai_error(400, f"{where}.content must be a string or a list of text parts", f"{where}.content")
        if calls is not None and (role != "assistant" or not _tool_calls_ok(calls)):
            raise openai_error(400, f"{where}.tool_calls must be an assistant's list of function calls",
                               f"{where}.tool_calls")
        entry = {"role": role, "content": content or ""}
        if calls:
            entry["tool_calls"] = [{"name": c["function"]["name"], "arguments": _arguments(c["function"])}
                                   for c in calls]
        out.append(entry)
    return out


def _tool_calls_ok(calls: Any) -> bool:
    return isinstance(calls, list) and all(
        isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
        for c in calls)


def _arguments(function: dict) -> Any:
    """A call's arguments as an object where they are JSON (the template writes them as such)."""
    arguments = function.get("arguments", "{}")
    try:
        return json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        return arguments


def _tools(value: Any) -> list[dict]:
    """`tools`: function tools with a name and (optional) JSON-schema object parameters."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise openai_error(400, "tools must be a list", "tools")
    tools = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise openai_error(400, f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}", where)
        name = function.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
            raise openai_error(400, f"{where}.function.name must be 1-64 letters, digits, _ or -, got {name!r}",
                               f"{where}.function.name")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise openai_error(400, f"{where}.function.parameters must be a JSON schema of type object",
                               f"{where}.function.parameters")
        tools.append({"type": "function", "function": {"name": name, "description": function.get("description", ""),
                                                       "parameters": parameters}})
    return tools


def render_chat(tokenizer: Any, messages: list[dict], tools: list[dict]) -> str:
    """The prompt text of a conversation: the tokenizer's chat template, tools included, ending
    where the assistant's answer starts."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise openai_error(400, "this model's tokenizer has no chat template: use /v1/completions", "messages")
    try:
        return tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                             tokenize=False)
    except TemplateSyntaxError:
        raise  # the model's template itself is broken: no request's fault (a 500)
    except TemplateError as exc:  # the template refuses these messages (raise_exception), or cannot read them
        raise openai_error(400, f"messages: the model's chat template refuses this conversation: {exc}",
                           "messages") from None


def chat_input(messages: Any, tools: Any) -> tuple[list[dict], list[dict]]:
    """A chat request's `messages` and `tools` checked and shaped as the chat template reads them
    (what the server renders; the agent gateway's chat map renders the same)."""
    return _messages(messages), _tools(tools)
