"""Logprob fields and parallel sampling of /generate on a real server, against a plain transformers
forward on the same weights (fp32): logprob_start_len and input_token_logprobs, top_logprobs_num,
return_text_in_logprobs, and sampling_params.n in SGLang's order and rid naming."""

from __future__ import annotations

import pytest
import torch
from generation_helpers import build_model, generate_ok, greedy_reference, running_server, save_model_dir

PROMPTS = [[2, 3, 4, 5, 6, 7, 8, 9, 10], [5, 6], [17, 16, 15, 14, 13]]


@torch.no_grad()
def reference_logprobs(model: torch.nn.Module, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) [len(ids), V] of one unpadded forward: row p predicts token p + 1."""
    return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float() / temperature, dim=-1)


def check_top(rows: list, reference: torch.Tensor, k: int) -> None:
    """Each row is the k most likely [logprob, id, text] of the matching reference row."""
    assert len(rows) == len(reference)
    for row, expected in zip(rows, reference):
        values, ids = expected.topk(k)
        assert [entry[1] for entry in row] == ids.tolist()
        torch.testing.assert_close(torch.tensor([entry[0] for entry in row]), values, atol=1e-4, rtol=0)


def test_input_token_logprobs_follow_logprob_start_len_in_a_padded_batch(server_a, ref_a):
    # Prompts of different lengths (left-padded together) and a different start each.
    starts = [0, 1, 3]
    answers = generate_ok(server_a, {"input_ids": PROMPTS, "return_logprob": True, "logprob_start_len": starts,
                                  "sampling_params": {"max_new_tokens": 4, "temperature": 0.7, "ignore_eos": True}})
    for prompt, start, answer in zip(PROMPTS, starts, answers):
        entries = answer["meta_info"]["input_token_logprobs"]
        assert [e[1] for e in entries] == prompt[start:] and len(entries) == len(prompt) - start
        assert entries[0][0] is None  # SGLang: the first reported prompt token has no logprob
        assert all(e[2] is None for e in entries)
        # Prompt logprobs are log_softmax of the raw logits (SGLang's default), whatever the temperature.
        reference = reference_logprobs(ref_a, prompt)
        expected = [reference[p - 1, prompt[p]] for p in range(start + 1, len(prompt))]
        torch.testing.assert_close(torch.tensor([e[0] for e in entries[1:]]), torch.tensor(expected),
                                   atol=1e-4, rtol=0)


def test_no_input_logprobs_by_default_at_the_prompt_end_or_without_return_logprob(server_a):
    prompt = PROMPTS[0]
    for extra, expected in (({}, []), ({"logprob_start_len": -1}, []),
                            ({"logprob_start_len": len(prompt)}, []),
                            ({"logprob_start_len": len(prompt) - 1}, [[None, prompt[-1], None]])):
        answer = generate_ok(server_a, {"input_ids": prompt, "return_logprob": True, **extra,
                                     "sampling_params": {"max_new_tokens": 2}})
        assert answer["meta_info"]["input_token_logprobs"] == expected, extra
    # Without return_logprob SGLang ignores the logprob fields (even a start past the prompt).
    answer = generate_ok(server_a, {"input_ids": prompt, "logprob_start_len": 99, "top_logprobs_num": 99,
                                 "sampling_params": {"max_new_tokens": 2}})
    assert not any("logprob" in key for key in answer["meta_info"])


def test_prefill_only_scoring_returns_prompt_logprobs_and_no_tokens(server_a, ref_a):
    """slime's on-policy distillation: max_new_tokens 0 with logprob_start_len 0."""
    prompt = PROMPTS[2]
    answer = generate_ok(server_a, {"input_ids": prompt, "return_logprob": True, "logprob_start_len": 0,
                                 "sampling_params": {"max_new_tokens": 0}})
    assert answer["output_ids"] == [] and answer["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    entries = answer["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == prompt and entries[0][0] is None
    reference = reference_logprobs(ref_a, prompt)
    torch.testing.assert_close(torch.tensor([e[0] for e in entries[1:]]),
                               torch.stack([reference[p - 1, prompt[p]] for p in range(1, len(prompt))]),
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("temperature", [0.7, 0.0])
def test_top_logprobs_are_the_most_likely_tokens_of_the_sampled_distribution(server_a, ref_a, temperature):
    prompt, k = PROMPTS[0], 3
    answer = generate_ok(server_a, {"input_ids": prompt, "return_logprob": True, "top_logprobs_num": k,
                                 "logprob_start_len": 2, "sampling_params": {
                                     "max_new_tokens": 6, "temperature": temperature, "ignore_eos": True}})
    meta, output = answer["meta_info"], answer["output_ids"]
    # Output: from log_softmax(logits / T), as the sampled token's logprob (greedy: T = 1).
    scaled = reference_logprobs(ref_a, prompt + output, temperature or 1.0)
    check_top(meta["output_top_logprobs"], scaled[len(prompt) - 1: -1], k)
    for (logprob, token, _), row in zip(meta["output_token_logprobs"], meta["output_top_logprobs"]):
        if token in [entry[1] for entry in row]:
            assert [entry[0] for entry in row if entry[1] == token] == [logprob]
    if temperature == 0:
        assert [row[0][1] for row in meta["output_top_logprobs"]] == output
    # Input: the first reported position has none, then the raw distribution at each position.
    assert meta["input_top_logprobs"][0] is None
    check_top(meta["input_top_logprobs"][1:], reference_logprobs(ref_a, prompt)[2: len(prompt) - 1], k)
    assert "input_top_logprobs" not in generate_ok(server_a, {"input_ids": prompt, "return_logprob": True})["meta_info"]


def test_return_text_in_logprobs_fills_the_third_entry_with_the_token_text(server_a, model_dirs, tmp_path):
    body = {"input_ids": PROMPTS[1], "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
            "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": 3}}
    meta = generate_ok(server_a, body)["meta_info"]
    decode = server_a.tokenizer.decode
    entries = meta["input_token_logprobs"] + meta["output_token_logprobs"] + [
        e for row in meta["output_top_logprobs"] + meta["input_top_logprobs"][1:] for e in row]
    assert all(e[2] == decode([e[1]]) and e[2] for e in entries)
    # Without a tokenizer (input_ids only, as SGLang's --skip-tokenizer-init) there is no text to give.
    with running_server(save_model_dir(build_model(seed=0), tmp_path / "bare", tokenizer=False)) as bare:
        meta = generate_ok(bare, body)["meta_info"]
        assert all(e[2] is None for e in meta["input_token_logprobs"] + meta["output_token_logprobs"])


def test_n_samples_each_prompt_in_sglang_order_with_fresh_rids(server_a, ref_a):
    sampling = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True, "n": 2}
    answers = generate_ok(server_a, {"input_ids": PROMPTS[:2], "sampling_params": sampling, "rid": "mine"})
    expected = [greedy_reference(ref_a, p, 5, stop_ids=()) for p in PROMPTS[:2]]
    assert [a["output_ids"] for a in answers] == [expected[0], expected[0], expected[1], expected[1]]
    rids = [a["meta_info"]["id"] for a in answers]
    assert len(set(rids)) == 4 and all(len(r) == 32 and "mine" not in r for r in rids)  # uuid hex, as SGLang

    # One prompt with n > 1 answers an array too; sampled answers differ and carry their own logprobs.
    answers = generate_ok(server_a, {"input_ids": PROMPTS[0], "return_logprob": True,
                                  "sampling_params": {"max_new_tokens": 12, "ignore_eos": True, "n": 3}})
    assert isinstance(answers, list) and len(answers) == 3
    assert len({tuple(a["output_ids"]) for a in answers}) > 1
    for answer in answers:
        triples = answer["meta_info"]["output_token_logprobs"]
        assert [t[1] for t in triples] == answer["output_ids"]
        reference = reference_logprobs(ref_a, PROMPTS[0] + answer["output_ids"])[len(PROMPTS[0]) - 1: -1]
        torch.testing.assert_close(torch.tensor([t[0] for t in triples]),
                                   reference.gather(1, torch.tensor(answer["output_ids"])[:, None]).squeeze(1),
                                   atol=1e-4, rtol=0)
    # n = 1 keeps the single-object form; a list of equal n per prompt is fine.
    single = generate_ok(server_a, {"input_ids": PROMPTS[1], "sampling_params": {"n": 1, "max_new_tokens": 1}})
    assert isinstance(single, dict)
    answers = generate_ok(server_a, {"input_ids": PROMPTS[:2],
                                  "sampling_params": [{"n": 2, "max_new_tokens": 1, "ignore_eos": True},
                                                      {"n": 2, "max_new_tokens": 3, "ignore_eos": True}]})
    assert [len(a["output_ids"]) for a in answers] == [1, 1, 3, 3]  # (an eos drawn would end one early)
