"""Weights by broadcast (rollout.weight_update_mode=distributed): two embedded servers as real
subprocesses join a gloo group with this process as trainer rank 0 (SGLang's
/init_weights_update_group), receive a model's weights in several buckets
(/update_weights_from_distributed) and then generate exactly what the same weights loaded from disk
generate; a bucket that does not fit the model is refused naming the tensor, and nothing of it is
loaded."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from generation_helpers import ModelDirs, http_call

from areal_flow.generation.client.generation_client import wait_healthy
from areal_flow.generation.engine.checkpoint import load_checkpoint
from areal_flow.runtime.ports import free_ports
from areal_flow.training.engine import bucketed
from areal_flow.weights import group as weight_group
from areal_flow.weights.sender import Server, WeightSender, WeightTransferError

REPO = Path(__file__).resolve().parents[2]
# Server processes of their own: the full suite runs these, the fast tier does not.
pytestmark = pytest.mark.slow
PROMPT = [2, 7, 3, 9]
GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
SAMPLED = {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": 7, "ignore_eos": True}


@pytest.fixture(scope="module")
def servers(model_dirs: ModelDirs, tmp_path_factory) -> list[str]:
    """Two server processes on model a, one torch thread each (so their floats agree)."""
    logs = tmp_path_factory.mktemp("server_logs")
    ports = free_ports(2)
    procs = [subprocess.Popen(
        [sys.executable, "-m", "areal_flow.generation.server", "--model-path", model_dirs.a, "--port", str(port),
         "--num-threads", "1", "--weight-version", "0", "--log-level", "WARNING"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=open(logs / f"server{i}.log", "w"))
        for i, port in enumerate(ports)]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    try:
        for url in urls:
            wait_healthy(url, timeout=90)
        yield urls
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=20)


@pytest.fixture(scope="module")
def sender(servers: list[str]) -> WeightSender:
    sender = WeightSender([Server(f"gen_server{i}", url) for i, url in enumerate(servers)], timeout=60)
    sender.connect()
    yield sender
    sender.close()


def answer(url: str, sampling: dict) -> tuple[list[int], list[float], list[int]]:
    status, _, body = http_call(url, "POST", "/generate",
                                {"input_ids": PROMPT, "sampling_params": sampling, "return_logprob": True})
    assert status == 200, body
    meta = body["meta_info"]
    return body["output_ids"], [lp for lp, _, _ in meta["output_token_logprobs"]], meta["output_token_versions"]


def from_disk(url: str, path: str, version: int) -> None:
    status, _, reply = http_call(url, "POST", "/update_weights_from_disk", {"model_path": path,
                                                                            "weight_version": str(version)})
    assert status == 200, reply


def test_weights_sent_in_buckets_generate_what_the_same_weights_from_disk_generate(servers, sender, model_dirs):
    for url in servers:
        from_disk(url, model_dirs.a, 0)
    before = [answer(servers[0], s) for s in (GREEDY, SAMPLED)]
    state = load_checkpoint(model_dirs.b)
    total = sum(t.numel() * t.element_size() for t in state.values())
    buckets = list(bucketed(iter(state.items()), total // 4))
    assert len(buckets) >= 4  # several buckets, in several requests

    report = sender.send(buckets, 5)
    assert (report.buckets, report.tensors, report.bytes) == (len(buckets), len(state), total)
    sent = [[answer(url, s) for s in (GREEDY, SAMPLED)] for url in servers]
    for url in servers:
        assert http_call(url, "GET", "/get_weight_version")[2] == {"weight_version": "5"}
    # The same weights from disk, on the same processes: token for token, logprob for logprob.
    for url in servers:
        from_disk(url, model_dirs.b, 6)
    disk = [[answer(url, s) for s in (GREEDY, SAMPLED)] for url in servers]
    for by_broadcast, by_disk in zip(sent, disk):
        for (ids, logprobs, versions), (disk_ids, disk_logprobs, disk_versions) in zip(by_broadcast, by_disk):
            assert ids == disk_ids and logprobs == disk_logprobs
            assert versions == [5] * 12 and disk_versions == [6] * 12
    assert [ids for ids, _, _ in sent[0]] != [ids for ids, _, _ in before]  # the weights did change


@pytest.mark.parametrize("fault", ["unknown name", "wrong shape", "integer dtype"])
def test_a_bucket_that_does_not_fit_is_refused_naming_the_tensor_and_nothing_of_it_loads(servers, sender,
                                                                                       model_dirs, fault):
    for url in servers:
        from_disk(url, model_dirs.a, 0)
    before = answer(servers[0], GREEDY)
    state_b = load_checkpoint(model_dirs.b)
    good = ("model.layers.0.mlp.down_proj.weight", state_b["model.layers.0.mlp.down_proj.weight"])
    bad = {"unknown name": ("model.layers.0.mlp.nope.weight", torch.ones(3, 3)),
           "wrong shape": ("model.norm.weight", torch.ones(7)),
           "integer dtype": ("model.norm.weight", torch.ones(32, dtype=torch.int64))}[fault]
    # The good tensor changes what is generated on its own; it must not be loaded either.
    with pytest.raises(WeightTransferError) as refused:
        sender.send_bucket([good, bad, ("lm_head.weight", state_b["lm_head.weight"])], 9)
    message = str(refused.value)
    assert "gen_server0 refused it" in message and "gen_server1 refused it" in message
    assert bad[0] in message and "keeps weight version 0" in message
    for url in servers:
        assert answer(url, GREEDY) == before
        assert http_call(url, "GET", "/get_weight_version")[2] == {"weight_version": "0"}
    # Each server received the refused bucket, so the group goes on working.
    assert not sender.broken
    sender.send_bucket([good, ("lm_head.weight", state_b["lm_head.weight"])], 10)
    assert answer(servers[1], GREEDY)[2] == [10] * 12 and answer(servers[1], GREEDY)[0] != before[0]


def test_requests_that_cannot_be_received_are_refused_naming_the_field(servers, sender):
    url = servers[0]
    init = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2}
    cases = [
        # SGLang's default backend
        ("/init_weights_update_group", init, "backend 'nccl' needs the engine on CUDA, and this server runs on cpu"),
        ("/init_weights_update_group", init | {"backend": "gloo", "rank_offset": 0}, "rank 0 is the trainer's"),
        ("/init_weights_update_group", init | {"backend": "gloo", "group_name": weight_group.DEFAULT_GROUP},
         "exists already"),
        ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"], "shapes": [[1]],
                                              "group_name": "other"}, "no weights group named 'other'"),
        ("/update_weights_from_distributed", {"names": ["a", "b"], "dtypes": ["float32"], "shapes": [[1]]},
         "same length"),
        ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["torch.float32"], "shapes": [[1]]},
         "tensor a: dtype 'torch.float32' is not a torch dtype name"),
        ("/destroy_weights_update_group", {"group_name": "other"}, "no weights group named 'other'"),
    ]
    for path, body, expected in cases:
        status, _, reply = http_call(url, "POST", path, body)
        assert status == 400 and reply["success"] is False and expected in reply["message"], (path, reply)


def test_a_peer_that_builds_its_group_as_sglang_does_meets_this_side(tmp_path):
    """SGLang's custom group: a tcp:// rendezvous, the store prefixed with the group name, then
    torch's group helper. Its ranks must find ours under the same store keys, or a real SGLang
    server would wait for the trainer forever."""
    name, world = "weight_update_group", 2
    store = weight_group.master_store("127.0.0.1", world, timeout=30)
    peer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import datetime, torch
        from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, rendezvous
        timeout = datetime.timedelta(seconds=30)
        store, rank, world = next(rendezvous("tcp://127.0.0.1:{store.port}", 1, {world}, timeout=timeout))
        group, _ = _new_process_group_helper(world, rank, [], Backend("gloo"), PrefixStore("{name}", store),
                                             group_name="{name}", timeout=timeout)
        tensor = torch.empty(5, dtype=torch.bfloat16)
        group.broadcast(tensor, 0).wait()
        print(tensor.float().tolist(), flush=True)
        # A gloo group still alive at interpreter exit can abort the process (std::terminate from
        # its threads; seen once in a full-suite run): not what this checks, so leave at once.
        import os
        os._exit(0)
    """)], stdout=subprocess.PIPE, text=True)
    group = weight_group.join(store, master_address="127.0.0.1", master_port=store.port, rank=0, world_size=world,
                              group_name=name, backend="gloo", timeout=30)
    weight_group.send(group, [("w", torch.tensor([1.5, -2.0, 0.25, 3.0, 8.0], dtype=torch.bfloat16))])
    out, _ = peer.communicate(timeout=60)
    assert peer.returncode == 0 and out.strip() == "[1.5, -2.0, 0.25, 3.0, 8.0]"


def test_lora_adapters_sent_by_broadcast_generate_what_the_same_adapters_from_disk_generate(servers, sender,
                                                                                             model_dirs, tmp_path):
    """A LoRA trainer's update by broadcast is its adapters alone, in one bucket with their config;
    each server applies them to its base (low-rank paths) and reports their digest (checked by the
    sender), and then generates bit for bit what the trainer's adapter directory from disk generates."""
    from test_lora_updates import trained

    from areal_flow.weights import adapter as adapter_files

    engine = trained(model_dirs.a)
    for url in servers:  # the base the adapters go with (the tests before sent other weights)
        from_disk(url, model_dirs.a, 0)
    buckets, config = engine.export_update(1 << 20)
    buckets = list(buckets)
    report = sender.send(buckets, 12, lora_config=config)
    assert report.buckets == 1 and report.tensors == len(buckets[0]) and all(".lora_" in n for n, _ in buckets[0])
    digest = adapter_files.digest(dict(buckets[0]))
    sent = []
    for url in servers:
        status, _, info = http_call(url, "POST", "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY})
        assert status == 200 and info["meta_info"]["adapter_digest"] == digest
        sent.append([answer(url, s) for s in (GREEDY, SAMPLED)])
    engine.save_update(str(tmp_path / "adapters"))
    for url, got in zip(servers, sent):
        from_disk(url, model_dirs.a, 13)  # the base again, then its adapters from disk
        from_disk(url, str(tmp_path / "adapters"), 14)
        disk = [answer(url, s) for s in (GREEDY, SAMPLED)]
        assert [(ids, lps) for ids, lps, _ in got] == [(ids, lps) for ids, lps, _ in disk]
