"""/generate and the info routes of a real server (in-process, free port) on a tiny real model."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from generation_helpers import (
    CONTEXT, EOS_ID, EOS_PROMPT, VOCAB_SIZE, ModelDirs, async_wait_until, full_forward_logprobs, generate_ok,
    greedy_reference, http_call, running_server,
)

from areal_flow.generation.client.generation_client import GenerationClient, GenerationError

PROMPTS = [[2, 3, 4, 5, 6, 7, 8, 9, 10], [5, 6], [11], [4, 4, 4, 4, 12, 13], [17, 16, 15, 14]]


def test_greedy_output_equals_plain_hf_argmax_decode(server_a, ref_a):
    for prompt in PROMPTS:
        answer = generate_ok(server_a, {"input_ids": prompt,
                                        "sampling_params": {"max_new_tokens": 24, "temperature": 0}})
        assert answer["output_ids"] == greedy_reference(ref_a, prompt, 24)
        meta = answer["meta_info"]
        assert meta["completion_tokens"] == len(answer["output_ids"])
        assert meta["prompt_tokens"] == len(prompt)
        assert meta["weight_version"] == "default"  # SGLang's initial label; its tokens are version 0
        assert meta["output_token_versions"] == [0] * len(answer["output_ids"])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_are_full_vocab_log_softmax_of_logits_over_temperature(server_a, ref_a, temperature):
    # top_k / top_p cut the sampling set but not the reported logprob (SGLang semantics).
    sampling = [{"max_new_tokens": 20, "temperature": temperature, "ignore_eos": True},
                {"max_new_tokens": 20, "temperature": temperature, "ignore_eos": True, "top_k": 4},
                {"max_new_tokens": 20, "temperature": temperature, "ignore_eos": True, "top_p": 0.8},
                {"max_new_tokens": 20, "temperature": temperature, "ignore_eos": True, "top_k": 6, "top_p": 0.9},
                {"max_new_tokens": 20, "temperature": temperature, "ignore_eos": True}]
    answers = generate_ok(server_a, {"input_ids": PROMPTS, "sampling_params": sampling, "return_logprob": True})
    for prompt, answer in zip(PROMPTS, answers):
        triples = answer["meta_info"]["output_token_logprobs"]
        assert [t[1] for t in triples] == answer["output_ids"] and len(triples) == 20
        assert all(t[2] is None for t in triples)
        assert answer["meta_info"]["input_token_logprobs"] == []
        expected = full_forward_logprobs(ref_a, prompt, answer["output_ids"], temperature)
        torch.testing.assert_close(torch.tensor([t[0] for t in triples]), expected, atol=1e-4, rtol=0)


def test_top_k_1_and_tiny_top_p_sample_the_argmax(server_a, ref_a):
    prompt = PROMPTS[0]
    expected = greedy_reference(ref_a, prompt, 16, stop_ids=())
    for cut in ({"top_k": 1}, {"top_p": 1e-9}):
        answer = generate_ok(server_a, {"input_ids": prompt,
                                     "sampling_params": {"max_new_tokens": 16, "ignore_eos": True, **cut}})
        assert answer["output_ids"] == expected, cut


def test_batch_form_answers_an_array_in_prompt_order(server_a, ref_a):
    sampling = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in (3, 9, 1, 5, 2)]
    answers = generate_ok(server_a, {"input_ids": PROMPTS, "sampling_params": sampling, "rid": "b7"})
    assert isinstance(answers, list) and len(answers) == len(PROMPTS)
    for i, (prompt, params, answer) in enumerate(zip(PROMPTS, sampling, answers)):
        assert answer["meta_info"]["id"] == f"b7_{i}"
        assert answer["output_ids"] == greedy_reference(ref_a, prompt, params["max_new_tokens"], stop_ids=())
        assert "output_token_logprobs" not in answer["meta_info"]  # return_logprob defaults to false


def test_max_new_tokens_ends_with_length_after_exactly_n_tokens(server_a):
    for n in (7, 1, 0):
        answer = generate_ok(server_a, {"input_ids": PROMPTS[1], "return_logprob": True,
                                     "sampling_params": {"max_new_tokens": n, "ignore_eos": True}})
        assert len(answer["output_ids"]) == n == answer["meta_info"]["completion_tokens"]
        assert len(answer["meta_info"]["output_token_logprobs"]) == n
        assert answer["meta_info"]["finish_reason"] == {"type": "length", "length": n}


def test_stop_token_ids_end_the_output_and_keep_the_stop_token(server_a, ref_a):
    prompt = PROMPTS[0]
    free_run = greedy_reference(ref_a, prompt, 30)  # up to the model's eos, which must not come first
    index = next(i for i in range(1, len(free_run)) if free_run[i] not in free_run[:i] + [EOS_ID])
    stop = free_run[index]
    answer = generate_ok(server_a, {"input_ids": prompt, "sampling_params": {
        "max_new_tokens": 30, "temperature": 0, "stop_token_ids": [stop]}})
    assert answer["output_ids"] == free_run[: index + 1]
    assert answer["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_eos_ends_the_output_and_is_kept_unless_ignore_eos(model_dirs: ModelDirs):
    with running_server(model_dirs.eos) as server:
        body = {"input_ids": EOS_PROMPT, "sampling_params": {"max_new_tokens": 30, "temperature": 0}}
        answer = generate_ok(server, body)
        assert len(answer["output_ids"]) == model_dirs.eos_index + 1
        assert answer["output_ids"][-1] == model_dirs.eos_token
        assert answer["meta_info"]["finish_reason"] == {"type": "stop", "matched": model_dirs.eos_token}
        body["sampling_params"]["ignore_eos"] = True
        answer = generate_ok(server, body)
        assert len(answer["output_ids"]) == 30
        assert answer["meta_info"]["finish_reason"]["type"] == "length"


def test_text_prompt_is_tokenized_and_output_detokenized(server_a, ref_a):
    answer = generate_ok(server_a, {"text": "c d e f", "sampling_params": {"max_new_tokens": 6, "temperature": 0,
                                                                      "ignore_eos": True}})
    assert answer["meta_info"]["prompt_tokens"] == 4
    assert answer["output_ids"] == greedy_reference(ref_a, [4, 5, 6, 7], 6, stop_ids=())
    assert answer["text"] == server_a.tokenizer.decode(answer["output_ids"], skip_special_tokens=True)


BAD_REQUESTS = {
    "unknown sampling key": ({"input_ids": [2, 3], "sampling_params": {"max_tokens": 8}}, "max_tokens"),
    "top_k 0": ({"input_ids": [2, 3], "sampling_params": {"top_k": 0}}, "top_k"),
    "top_p 0": ({"input_ids": [2, 3], "sampling_params": {"top_p": 0}}, "top_p"),
    "negative temperature": ({"input_ids": [2, 3], "sampling_params": {"temperature": -1}}, "temperature"),
    "negative max_new_tokens": ({"input_ids": [2, 3], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    "string max_new_tokens": ({"input_ids": [2, 3], "sampling_params": {"max_new_tokens": "8"}}, "max_new_tokens"),
    "unsupported penalty": ({"input_ids": [2], "sampling_params": {"frequency_penalty": 0.5}}, "frequency_penalty"),
    "empty input_ids": ({"input_ids": []}, "input_ids"),
    "empty prompt in batch": ({"input_ids": [[2], []]}, "input_ids"),
    "id outside vocab": ({"input_ids": [2, VOCAB_SIZE]}, "input_ids"),
    "no prompt": ({}, "input_ids"),
    "too long": ({"input_ids": [2] * 10, "sampling_params": {"max_new_tokens": CONTEXT}}, "context length"),
    "batch sampling list of wrong length": ({"input_ids": [[2], [3]], "sampling_params": [{}]}, "sampling_params"),
    "stream not a bool": ({"input_ids": [2], "stream": "yes"}, "stream must be true or false"),
    "stream with a bad field": ({"input_ids": [2], "stream": True, "sampling_params": {"top_k": 0}}, "top_k"),
    "stream_interval 0": ({"input_ids": [2], "stream": True, "sampling_params": {"stream_interval": 0}},
                          "sampling_params.stream_interval"),
    "n 0": ({"input_ids": [2], "sampling_params": {"n": 0}}, "sampling_params.n"),
    "n huge": ({"input_ids": [2], "sampling_params": {"n": 10**6}}, "sampling_params.n"),
    "n a string": ({"input_ids": [2], "sampling_params": {"n": "2"}}, "sampling_params.n"),
    "n differs in a batch": ({"input_ids": [[2], [3]], "sampling_params": [{"n": 1}, {"n": 2}]},
                             "sampling_params.n must be the same"),
    "n with a list of return_logprob": ({"input_ids": [[2], [3]], "return_logprob": [True, False],
                                         "sampling_params": {"n": 2}}, "return_logprob"),
    "top_logprobs_num negative": ({"input_ids": [2], "return_logprob": True, "top_logprobs_num": -1},
                                  "top_logprobs_num"),
    "top_logprobs_num over the vocab": ({"input_ids": [2], "return_logprob": True,
                                         "top_logprobs_num": VOCAB_SIZE + 1}, "top_logprobs_num"),
    "top_logprobs_num a float": ({"input_ids": [2], "top_logprobs_num": 1.5}, "top_logprobs_num"),
    "logprob_start_len past the prompt": ({"input_ids": [2, 3], "return_logprob": True, "logprob_start_len": 3},
                                          "logprob_start_len"),
    "logprob_start_len below -1": ({"input_ids": [2, 3], "return_logprob": True, "logprob_start_len": -2},
                                   "logprob_start_len"),
    "logprob_start_len a string": ({"input_ids": [2, 3], "logprob_start_len": "0"}, "logprob_start_len"),
    "logprob_start_len list in a batch past one prompt": (
        {"input_ids": [[2, 3, 4], [2]], "return_logprob": True, "logprob_start_len": [1, 2]}, "logprob_start_len"),
    "return_text_in_logprobs not a bool": ({"input_ids": [2], "return_text_in_logprobs": 1},
                                           "return_text_in_logprobs"),
    "bad json": (b'{"input_ids": [2, 3', "not valid JSON"),
    "json array body": (b"[1, 2]", "JSON object"),
}


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=list(BAD_REQUESTS))
def test_bad_request_gets_400_naming_the_field_and_the_server_keeps_serving(server_a, case):
    body, expected = BAD_REQUESTS[case]
    status, headers, payload = http_call(server_a.url, "POST", "/generate", body)
    assert status == 400
    assert headers["content-type"] == "application/json"
    assert expected in payload["error"]["message"]
    answer = generate_ok(server_a, {"input_ids": [2, 3], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}})
    assert len(answer["output_ids"]) == 2


def test_unknown_route_and_wrong_method(server_a):
    status, _, payload = http_call(server_a.url, "GET", "/nope")
    assert status == 404 and "/nope" in payload["error"]["message"]
    status, _, payload = http_call(server_a.url, "GET", "/generate")
    assert status == 405


def test_health_info_and_flush_cache_routes(server_a, model_dirs):
    status, _, payload = http_call(server_a.url, "GET", "/health")
    assert (status, payload) == (200, "")
    status, _, info = http_call(server_a.url, "GET", "/get_model_info")
    assert status == 200 and info["is_generation"] is True and info["model_path"] == model_dirs.a
    assert info["weight_version"] == "default" and info["architectures"] == ["Qwen2ForCausalLM"]
    status, _, info = http_call(server_a.url, "GET", "/get_server_info")
    assert status == 200 and info["max_batch_size"] == 64 and info["weight_version"] == "default"
    assert info["context_length"] == CONTEXT and info["internal_states"][0]["num_running_reqs"] == 0
    status, _, _ = http_call(server_a.url, "POST", "/flush_cache")
    assert status == 200


def test_duplicate_in_flight_rid_is_refused_then_free_again(server_a):
    async def scenario() -> None:
        async with GenerationClient(server_a.url) as client:
            long = asyncio.create_task(client.generate([2, 3], {"max_new_tokens": 250, "ignore_eos": True}, rid="dup"))
            stats = server_a.engine.stats
            await async_wait_until(lambda: long.done() or stats()["num_running_reqs"] > 0, "the long request")
            assert not long.done()
            with pytest.raises(GenerationError) as refused:
                await client.generate([4], {"max_new_tokens": 1}, rid="dup")
            assert refused.value.status == 400 and "dup" in str(refused.value)
            assert len((await long)["output_ids"]) == 250
            again = await client.generate([4], {"max_new_tokens": 1}, rid="dup")
            assert again["meta_info"]["id"] == "dup"

    asyncio.run(scenario())


def test_forty_concurrent_requests_from_the_asyncio_client_all_answer_correctly(server_a, ref_a):
    rng = random.Random(0)
    cases = [([rng.randrange(2, VOCAB_SIZE) for _ in range(rng.randint(1, 12))], rng.randint(1, 24))
             for _ in range(40)]

    async def run_all() -> list[dict]:
        async with GenerationClient(server_a.url) as client:  # 40 connections opened at once
            return await asyncio.gather(*(
                client.generate(prompt, {"max_new_tokens": n, "temperature": 0}, rid=f"c{i}")
                for i, (prompt, n) in enumerate(cases)))

    answers = asyncio.run(run_all())
    for i, ((prompt, n), answer) in enumerate(zip(cases, answers)):
        assert answer["meta_info"]["id"] == f"c{i}"
        assert answer["output_ids"] == greedy_reference(ref_a, prompt, n), i
        logprobs = [t[0] for t in answer["meta_info"]["output_token_logprobs"]]
        torch.testing.assert_close(torch.tensor(logprobs),
                                   full_forward_logprobs(ref_a, prompt, answer["output_ids"], 1.0), atol=1e-4, rtol=0)


def test_client_batch_form_small_pool_and_server_info(server_a, ref_a):
    sampling = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}

    async def scenario() -> tuple[list[dict], list[dict], dict, bool]:
        # Two connections for ten concurrent calls: the pool queues them and reuses connections.
        async with GenerationClient(server_a.url, max_connections=2) as client:
            batch = await client.generate_batch(PROMPTS[:2], sampling)
            singles = await asyncio.gather(*(client.generate(PROMPTS[i % 5], sampling) for i in range(10)))
            return batch, singles, await client.get_server_info(), await client.health()

    batch, singles, info, healthy = asyncio.run(scenario())
    expected = [greedy_reference(ref_a, p, 4, stop_ids=()) for p in PROMPTS]
    assert [a["output_ids"] for a in batch] == expected[:2]
    assert [a["output_ids"] for a in singles] == [expected[i % 5] for i in range(10)]
    assert info["engine"] == "areal_flow-embedded" and healthy


def test_server_info_reports_compute_busy_seconds_that_grow_only_with_work(server_a):
    import time

    def busy() -> float:
        status, _, info = http_call(server_a.url, "GET", "/get_server_info", None)
        assert status == 200
        return info["busy_seconds"]

    before = busy()
    generate_ok(server_a, {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}})
    after_work = busy()
    assert after_work > before
    time.sleep(0.3)
    assert busy() - after_work < 0.05  # an idle server accrues (almost) nothing
