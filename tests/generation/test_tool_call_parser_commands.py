"""generation.tool_call_parser from the config to each place that reads tool calls: the embedded
server's command line and flag, SGLang's `--tool-call-parser` (its names; `auto` resolved from
the model's chat template, as the embedded server resolves it), and the agent gateway's
re-derivation of a resumed answer (agents/resume.py)."""

from __future__ import annotations

import json

import pytest
from generation_helpers import save_chat_model

from areal_flow.agents import resume
from areal_flow.config.schema import GenerationConfig, RunConfig
from areal_flow.config.validate import check_ranges
from areal_flow.generation.http.cli import parser
from areal_flow.generation.http.server import serve
from areal_flow.generation.sglang_backend import generation_problems, sglang_command, sglang_tool_call_parser
from areal_flow.models.tokenizer import CHAT_TEMPLATE

LLAMA_TEMPLATE = ("{{- 'Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name "
                  "and its value}.' }}{{- '<|python_tag|>' }}")


def model_dir(path, template: str):
    path.mkdir()
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return str(path)


def flag(argv: list[str]) -> str | None:
    return argv[argv.index("--tool-call-parser") + 1] if "--tool-call-parser" in argv else None


def test_sglang_servers_that_chat_get_the_parser_under_sglang_s_name(tmp_path):
    qwen, llama = model_dir(tmp_path / "q", CHAT_TEMPLATE), model_dir(tmp_path / "l", LLAMA_TEMPLATE)
    gen = GenerationConfig(backend="sglang")
    assert flag(sglang_command(gen, qwen, 1, 0, "cuda", tokenizer=True)) == "qwen25"  # auto: Qwen's <tool_call>
    assert flag(sglang_command(gen, llama, 1, 0, "cuda", tokenizer=True)) == "llama3"
    assert flag(sglang_command(gen, qwen, 1, 0, "cuda")) is None  # token ids in and out: no chat, no parsing
    for name, sglang_name in (("hermes", "qwen25"), ("qwen", "qwen25"), ("llama3_json", "llama3"),
                              ("mistral", "mistral"), ("pythonic", "pythonic"), ("llama4_pythonic", "pythonic")):
        set_ = GenerationConfig(backend="sglang", tool_call_parser=name)
        assert flag(sglang_command(set_, llama, 1, 0, "cuda", tokenizer=True)) == sglang_name
    assert sglang_tool_call_parser("auto", str(tmp_path / "none")) == "qwen25"  # no template: hermes, as embedded


def test_extra_args_may_not_set_the_parser():
    gen = GenerationConfig(backend="sglang", extra_args=["--tool-call-parser", "qwen3_coder"])
    (problem,) = generation_problems(gen, 1)
    assert "generation.tool_call_parser" in problem and "set that key instead" in problem


def test_the_embedded_server_command_passes_a_set_parser():
    from areal_flow.graph.placement import Proc
    from areal_flow.launchers.commands import server_command

    proc = Proc("gen_server0", "gen_server", (0,))
    argv, _ = server_command(RunConfig(generation=GenerationConfig(tool_call_parser="mistral")), proc, "/m", 1)
    assert flag(argv) == "mistral"
    assert flag(server_command(RunConfig(), proc, "/m", 1)[0]) is None  # auto: the server reads its template


def test_a_bad_name_is_refused_naming_the_key_or_flag(capsys):
    assert check_ranges(RunConfig(generation=GenerationConfig(tool_call_parser="qwen3_coder"))) == [
        "generation.tool_call_parser='qwen3_coder' must be one of auto, hermes, llama3, mistral, pythonic, qwen25, "
        "qwen, llama3_json, llama4_pythonic"]
    assert parser().parse_args(["--model-path", "m", "--tool-call-parser", "qwen25"]).tool_call_parser == "qwen25"
    with pytest.raises(SystemExit):
        parser().parse_args(["--model-path", "m", "--tool-call-parser", "xml"])
    assert "--tool-call-parser: invalid choice: 'xml'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="tool_call_parser='xml'"):  # before any model is loaded
        serve("/no/such/model", tool_call_parser="xml")


def _resumed_choice(tokenizer, text: str) -> dict:
    ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    return {"token_ids": ids, "output_token_logprobs": [-1.0] * len(ids), "output_token_versions": [3] * len(ids),
            "finish_reason": "stop", "matched_stop": tokenizer.eos_token_id, "weight_version": "3"}


def test_a_resumed_answer_s_calls_are_read_by_the_run_s_parser(tmp_path):
    tokenizer = save_chat_model(tmp_path)
    tools = [{"type": "function", "function": {"name": n}} for n in ("f", "g")]
    body = {"model": "m", "tools": tools}
    pythonic = _resumed_choice(tokenizer, "[f(x=1), g(y='a')]")
    whole = resume.rederived(body, True, 0, pythonic, "m", tokenizer, tool_call_parser="pythonic")
    assert whole["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in whole["message"]["tool_calls"]] == ["f", "g"]
    # auto: the policy's template (Qwen's here), as the servers resolve it: no call in pythonic text.
    assert resume.rederived(body, True, 0, pythonic, "m", tokenizer)["finish_reason"] == "stop"
    # The call's tool_choice and parallel_tool_calls hold for the resumed answer as for the server's.
    named = {**body, "tool_choice": {"type": "function", "function": {"name": "g"}}}
    whole = resume.rederived(named, True, 0, pythonic, "m", tokenizer, tool_call_parser="pythonic")
    assert [c["function"] for c in whole["message"]["tool_calls"]] == [{"name": "g", "arguments": '{"y": "a"}'}]
    first = resume.rederived({**body, "parallel_tool_calls": False}, True, 0, pythonic, "m", tokenizer,
                             tool_call_parser="pythonic")
    assert [c["function"]["name"] for c in first["message"]["tool_calls"]] == ["f"]

