"""How a tool's answer is written into a trajectory: shared by the python_tool environment, which
writes it at run time, and the reference traces a tiny model is bootstrapped on (models/tasks.py),
which must show the model the very tokens it will read."""

from __future__ import annotations

PYTHON_OPEN, PYTHON_CLOSE = "<python>", "</python>"  # python_tool's default tags around a call
OUTPUT_OPEN, OUTPUT_CLOSE = "<output>", "</output>"  # around what the call printed
MAX_OUTPUT_CHARS = 256  # python_tool's default cut


def cut(text: str, limit: int) -> str:
    """`text` up to `limit` characters, with a marker saying how many more there were."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}\n[cut: {len(text) - limit} more characters]"


def output_observation(text: str, limit: int = MAX_OUTPUT_CHARS) -> str:
    """The observation of a tool run that printed (or failed with) `text`: cut at `limit` characters,
    in output tags on lines of their own."""
    return f"\n{OUTPUT_OPEN}\n{cut(text, limit)}\n{OUTPUT_CLOSE}\n"


def call_text(fn_name: str, args: list) -> str:
    """A call as tiny_code's prompts write it: `name(arg, ...)`, each argument's repr."""
    return f"{fn_name}({', '.join(map(repr, args))})"


def failed_test(call: str, expected: object, got: str, limit: int = MAX_OUTPUT_CHARS) -> str:
    """The observation after an attempt that failed a test, in the prompt's own comment style:
    `# failed: name(args) == expected, got what_it_gave` (a repr, an error or `timeout`), cut at
    `limit` characters."""
    return f"# failed: {cut(f'{call} == {expected!r}, got {got}', limit)}\n"


PYTHON_FUNCTION = {"type": "function", "function": {
    "name": "python", "description": "Run Python code and read what it printed.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}
"""The Python tool as a chat agent declares it (`tools`), in the shape the server hands its chat
template (openai_api.chat_input keeps this order): tiny_arith_chat_agent's agent and the traces its
model is bootstrapped on (models/tasks.py) render the same text."""
