"""/update_weights_from_disk on a real server: new weights, new versions (SGLang's string labels
and areal_flow's integer token versions), bad paths refused."""

from __future__ import annotations

import asyncio
import http.client
import json

import pytest
from generation_helpers import ModelDirs, async_wait_until, greedy_reference, http_call, load_reference, running_server

from areal_flow.generation.client.generation_client import GenerationClient, GenerationError
from areal_flow.generation.http.server import GenerationServer, serve

PROMPT = [2, 7, 3, 9]
GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture
def server(model_dirs: ModelDirs) -> GenerationServer:
    server, thread = serve(model_dirs.a)
    yield server
    server.stop()
    thread.join(timeout=10)


def generate(server: GenerationServer, prompt: list[int], sampling: dict) -> dict:
    status, _, answer = http_call(server.url, "POST", "/generate", {"input_ids": prompt, "sampling_params": sampling})
    assert status == 200, answer
    return answer


def test_update_switches_outputs_weight_version_and_token_versions(server, model_dirs):
    expected_a = greedy_reference(load_reference(model_dirs.a), PROMPT, 12, stop_ids=())
    expected_b = greedy_reference(load_reference(model_dirs.b), PROMPT, 12, stop_ids=())
    assert expected_a != expected_b  # otherwise the test could not see the switch

    before = generate(server, PROMPT, GREEDY)
    assert before["output_ids"] == expected_a and before["meta_info"]["weight_version"] == "default"
    assert before["meta_info"]["output_token_versions"] == [0] * 12

    status, _, reply = http_call(server.url, "POST", "/update_weights_from_disk",
                                 {"model_path": model_dirs.b, "weight_version": "3", "abort_all_requests": True})
    assert status == 200 and reply["success"] is True and reply["num_paused_requests"] == 0

    after = generate(server, PROMPT, GREEDY)
    assert after["output_ids"] == expected_b
    assert after["meta_info"]["weight_version"] == "3"
    assert after["meta_info"]["output_token_versions"] == [3] * 12
    _, _, info = http_call(server.url, "GET", "/get_model_info")
    assert info["weight_version"] == "3" and info["model_path"] == model_dirs.b

    # Without weight_version the new weights still get a new token version; the label stays (SGLang).
    http_call(server.url, "POST", "/update_weights_from_disk", {"model_path": model_dirs.a})
    again = generate(server, PROMPT, GREEDY)
    assert again["output_ids"] == expected_a and again["meta_info"]["output_token_versions"] == [4] * 12
    assert again["meta_info"]["weight_version"] == "3"


@pytest.mark.parametrize("where", ["missing", "not a model", "other architecture"])
def test_bad_weights_are_refused_and_the_old_weights_keep_serving(server, model_dirs, tmp_path, where):
    path = {"missing": str(tmp_path / "nowhere"), "not a model": str(tmp_path),
            "other architecture": model_dirs.wide}[where]
    before = generate(server, PROMPT, GREEDY)

    async def update() -> None:
        async with GenerationClient(server.url) as client:
            await client.update_weights_from_disk(path, 1)

    with pytest.raises(GenerationError) as refused:
        asyncio.run(update())
    assert refused.value.status == 400
    assert refused.value.body["success"] is False and path in refused.value.body["message"]
    after = generate(server, PROMPT, GREEDY)
    assert after["output_ids"] == before["output_ids"]
    assert after["meta_info"]["weight_version"] == "default"
    assert after["meta_info"]["output_token_versions"] == [0] * 12


def test_any_label_is_a_weight_version_and_token_versions_stay_integers(server, model_dirs):
    """SGLang takes any string label; areal_flow tags tokens with integers: a label of digits sets
    the integer, any other label advances it by one."""
    for label, tag in (("v2", 1), ("7", 7), ("step-8", 8), ("0", 0)):
        status, _, reply = http_call(server.url, "POST", "/update_weights_from_disk",
                                     {"model_path": model_dirs.b, "weight_version": label})
        assert status == 200 and reply["message"].endswith(f"Weight version updated to {label}."), reply
        meta = generate(server, PROMPT, GREEDY)["meta_info"]
        assert (meta["weight_version"], meta["output_token_versions"]) == (label, [tag] * 12)
        assert http_call(server.url, "GET", "/model_info")[2]["weight_version"] == label
        assert http_call(server.url, "GET", "/get_weight_version")[2] == {"weight_version": label}


@pytest.mark.parametrize("bad", ["", "  ", True, 1.5, ["v1"], -1])
def test_bad_weight_version_is_refused_and_the_version_kept(server, model_dirs, bad):
    status, _, reply = http_call(server.url, "POST", "/update_weights_from_disk",
                                 {"model_path": model_dirs.b, "weight_version": bad})
    assert status == 400 and reply["success"] is False and "weight_version" in reply["message"]
    meta = generate(server, PROMPT, GREEDY)["meta_info"]
    assert (meta["weight_version"], meta["output_token_versions"]) == ("default", [0] * 12)
    status, _, reply = http_call(server.url, "POST", "/update_weights_from_disk", {})
    assert status == 400 and "model_path" in reply["message"]


def test_the_initial_label_comes_from_the_command_line_as_sglang_s_weight_version(model_dirs):
    for label, tag in (("0", 0), ("12", 12), ("base", 0)):
        with running_server(model_dirs.a, weight_label=label) as server:
            meta = generate(server, PROMPT, GREEDY)["meta_info"]
            assert (meta["weight_version"], meta["output_token_versions"]) == (label, [tag] * 12)
            status, _, _ = http_call(server.url, "POST", "/update_weights_from_disk", {"model_path": model_dirs.b})
            assert status == 200  # no label given: the label stays, the token version advances
            meta = generate(server, PROMPT, GREEDY)["meta_info"]
            assert (meta["weight_version"], meta["output_token_versions"]) == (label, [tag + 1] * 12)


def test_update_lands_between_batches_and_never_mixes_weights_in_a_request(server, model_dirs):
    """A running request finishes on the old weights; one sent while the update waits runs on the new."""
    long_prompt, n_long = [5, 6, 7], 200
    expected_long = greedy_reference(load_reference(model_dirs.a), long_prompt, n_long, stop_ids=())
    expected_new = greedy_reference(load_reference(model_dirs.b), PROMPT, 12, stop_ids=())
    engine = server.engine

    async def scenario() -> tuple[dict, dict]:
        async with GenerationClient(server.url) as client:
            long = asyncio.create_task(client.generate(
                long_prompt, {"max_new_tokens": n_long, "temperature": 0, "ignore_eos": True}))
            await async_wait_until(lambda: long.done() or engine.stats()["num_running_reqs"] > 0, "a running batch")
            update = asyncio.create_task(client.update_weights_from_disk(model_dirs.b, 1))
            await async_wait_until(lambda: update.done() or engine.stats()["num_pending_weight_updates"] > 0,
                                   "the update to queue")
            assert not long.done() and not update.done()  # the update really waits on the running batch
            newcomer = await client.generate(PROMPT, GREEDY)
            await update
            return await long, newcomer

    long_answer, newcomer = asyncio.run(scenario())
    # Every token of the running request came from the old weights, even though the update was
    # requested mid-way; the request sent while the update waited ran entirely on the new ones.
    assert long_answer["output_ids"] == expected_long
    assert long_answer["meta_info"]["output_token_versions"] == [0] * n_long
    assert newcomer["output_ids"] == expected_new
    assert newcomer["meta_info"]["output_token_versions"] == [1] * 12


def test_a_failing_decode_step_answers_500_and_the_engine_keeps_serving(server, model_dirs, tmp_path):
    """NaN weights make sampling raise inside the engine: that request gets a 500, the engine lives on."""
    model = load_reference(model_dirs.a)
    for parameter in model.parameters():
        parameter.data.fill_(float("nan"))
    model.save_pretrained(tmp_path / "nan")
    http_call(server.url, "POST", "/update_weights_from_disk", {"model_path": str(tmp_path / "nan")})

    connection = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=60)
    try:
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4}}
        connection.request("POST", "/generate", json.dumps(body))
        answer = connection.getresponse()
        assert answer.status == 500 and "error" in json.loads(answer.read())
        sock = connection.sock
        connection.request("GET", "/health")
        assert connection.getresponse().status == 200
        assert connection.sock is sock  # the 500 did not cost the keep-alive connection either
    finally:
        connection.close()

    status, _, reply = http_call(server.url, "POST", "/update_weights_from_disk", {"model_path": model_dirs.a})
    assert status == 200, reply
    expected = greedy_reference(load_reference(model_dirs.a), PROMPT, 12, stop_ids=())
    assert generate(server, PROMPT, GREEDY)["output_ids"] == expected
