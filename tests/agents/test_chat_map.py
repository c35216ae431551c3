"""An agent's chat history mapped back onto its tokens (agents/chat_map.py), with the project's
ChatML template and its Qwen2.5 tool format."""

import json

from areal_flow.agents.chat_map import ChatMap
from areal_flow.models.tokenizer import CODE_CHARS, IM_END, build_char_tokenizer

TOK = build_char_tokenizer(CODE_CHARS, chat=True)
PYTHON = {"type": "function", "function": {"name": "python", "description": "Run Python.",
                                           "parameters": {"type": "object", "properties": {"code": {"type": "string"}}}}}
USER = {"role": "user", "content": "12+30="}


def enc(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


def render(messages, prompt=True) -> str:
    from areal_flow.generation.http.openai_api import chat_input

    msgs, tools = chat_input(messages, [PYTHON])
    return TOK.apply_chat_template(msgs, tools=tools, add_generation_prompt=prompt, tokenize=False)


def answered(arguments: str) -> dict:
    """The message the server returns for a call of `python` (OpenAI's shape, as the client dumps it)."""
    return {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "python", "arguments": arguments}}]}


def test_a_tool_call_s_history_is_the_policy_s_tokens_then_the_template_s_turn_end_and_what_the_agent_added():
    chats = ChatMap(TOK)
    assert chats.tokens([USER], [PYTHON]) is None  # nothing known: the server renders it
    prompt = enc(render([USER]))
    # The policy spaced its JSON otherwise than the template writes it, and ended at <|im_end|>.
    answer = enc('<tool_call>\n{"name":"python","arguments":{"code":"print(12+30)"}}\n</tool_call>' + IM_END)
    message = answered(json.dumps({"code": "print(12+30)"}))
    chats.learn([USER], [PYTHON], prompt, [(message, answer)])
    history = [USER, message, {"role": "tool", "tool_call_id": "call_0", "content": "42\n"}]
    got = chats.tokens(history, [PYTHON])
    # The policy's tokens, then the newline the template writes after <|im_end|> and the tool's turn.
    added = enc("\n<|im_start|>user\n<tool_response>\n42\n\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert got == [*prompt, *answer, *added]
    rendered = enc(render(history))  # what the server would have tokenized: not the policy's tokens
    assert rendered[: len(prompt) + len(answer)] != [*prompt, *answer]
    # The same conversation asked again (another sample of that turn) is its own tokens.
    assert chats.tokens([USER], [PYTHON]) == prompt


def test_an_answer_cut_before_its_eos_gets_the_whole_turn_end_and_the_longest_known_start_wins():
    chats = ChatMap(TOK)
    prompt = enc(render([USER]))
    cut = enc("#### 4")  # the budget ran out: no <|im_end|> generated
    message = {"role": "assistant", "content": "#### 4"}
    chats.learn([USER], [PYTHON], prompt, [(message, cut)])
    second = [USER, message, {"role": "user", "content": "again"}]
    got = chats.tokens(second, [PYTHON])
    assert got == [*prompt, *cut, *enc(IM_END + "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n")]
    chats.learn(second, [PYTHON], got, [({"role": "assistant", "content": "#### 42"}, enc("#### 42" + IM_END))])
    third = [*second, {"role": "assistant", "content": "#### 42"}, {"role": "user", "content": "ok"}]
    assert chats.tokens(third, [PYTHON])[: len(got) + 8] == [*got, *enc("#### 42" + IM_END)]


def test_other_tools_an_edited_answer_or_a_malformed_request_are_left_to_the_server():
    chats = ChatMap(TOK)
    prompt = enc(render([USER]))
    chats.learn([USER], [PYTHON], prompt, [({"role": "assistant", "content": "#### 42"}, enc("#### 42" + IM_END))])
    more = [{"role": "user", "content": "next"}]
    assert chats.tokens([USER, {"role": "assistant", "content": "#### 42"}, *more], []) is None  # tools differ
    assert chats.tokens([USER, {"role": "assistant", "content": "#### 41"}, *more], [PYTHON]) is None  # edited
    assert chats.tokens([{"role": "robot", "content": "x"}], [PYTHON]) is None  # the server answers the 400


def test_the_chat_tool_bootstrap_teaches_the_tokens_an_agent_s_conversation_maps_to():
    # models/tasks.py writes the chat agent's traces by hand: they must be the very tokens the
    # gateway gives the policy for arith_chat_tool's conversation (prompt, call, tool result).
    from areal_flow.data.observations import PYTHON_FUNCTION
    from areal_flow.models.tasks import TASKS, chat_prompt, chat_tool_completion

    task = TASKS["tiny_arith_chat_tool"]
    tok = build_char_tokenizer(task.chars, chat=True, words=task.words, eos=task.eos)
    chats = ChatMap(tok)
    user = {"role": "user", "content": "12+30="}
    prompt = tok.encode(chat_prompt("12+30="), add_special_tokens=False)
    assert chats.tokens([user], [PYTHON_FUNCTION]) is None and len(prompt) < 40  # the tools' text: 3 tokens
    (call, _), (result, _), (final, _) = chat_tool_completion(12, 30)
    message = answered(json.dumps({"code": "print(12+30)"}))
    chats.learn([user], [PYTHON_FUNCTION], prompt, [(message, tok.encode(call, add_special_tokens=False))])
    history = [user, message, {"role": "tool", "tool_call_id": "call_0", "content": "42\n"}]
    assert chats.tokens(history, [PYTHON_FUNCTION]) == tok.encode(chat_prompt("12+30=") + call + result,
                                                                  add_special_tokens=False)
    assert tok.eos_token == IM_END and final == "#### 42"
