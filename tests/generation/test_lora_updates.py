"""LoRA weight updates (training.lora): the trainer writes its adapters alone, a real server merges them
into its fp32 copy of the base, bit for bit as the trainer merges them, reports their digest with
the update and with every answer, and an adapter that does not arrive as sent stops the update naming
the server and the version."""

import asyncio
import os
from functools import partial

import numpy as np
import pytest
import torch
from generation_helpers import ModelDirs, generate_ok, running_server

from areal_flow.algorithms.library import objective
from areal_flow.config.schema import AlgorithmConfig, RolloutConfig
from areal_flow.generation.client.generation_client import GenerationClient, GenerationError
from areal_flow.generation.client.router import ServerPool
from areal_flow.generation.engine.generation_engine import GenerationEngine
from areal_flow.training.engine import OptimSpec
from areal_flow.training.lora import LoraSpec
from areal_flow.training.torch_engine import TorchEngine
from areal_flow.weights import adapter as adapter_files
from areal_flow.weights.files import DIGEST, FileChannel
from areal_flow.weights.update import WeightUpdateError, update_servers

SPEC = LoraSpec(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "gate_proj"), init="gaussian")


def trained(model_dir: str) -> TorchEngine:
    """A LoRA trainer one step past its base."""
    torch.manual_seed(0)
    engine = TorchEngine(model_dir, optim=OptimSpec(lr=1e-2), micro_batch_tokens=256, lora=SPEC)
    rng = np.random.default_rng(0)
    seqs = [(rng.integers(2, 16, 5), rng.integers(2, 16, 6)) for _ in range(6)]
    data = {"prox_logprobs": [np.full(6, -2.5, np.float32)] * 6, "behav_logprobs": [np.full(6, -2.5, np.float32)] * 6,
            "advantages": [np.full(6, a, np.float32) for a in (1, -1, 1, -1, 0.5, -0.5)]}
    engine.train_step(seqs, data, partial(objective, algo=AlgorithmConfig(), prox_source="data", prox_version=0,
                                          kl_coef=0.0))
    engine.version = 1
    return engine


@pytest.fixture(scope="module")
def update(model_dirs: ModelDirs, tmp_path_factory):
    """(the trainer, the adapter directory it wrote as version 1, its digest)."""
    engine = trained(model_dirs.a)
    path = str(tmp_path_factory.mktemp("weights") / "v1")
    digest = engine.save_update(path)
    return engine, path, digest


def call(server, coro_fn):
    async def go():
        client = GenerationClient(server.url)
        try:
            return await coro_fn(client)
        finally:
            await client.close()
    return asyncio.run(go())


def test_the_update_carries_the_adapters_alone_and_is_a_peft_directory(update, model_dirs):
    engine, path, digest = update
    assert sorted(os.listdir(path)) == ["adapter_config.json", "adapter_model.safetensors"]
    config, tensors = adapter_files.read_dir(path)
    assert config["base_model_name_or_path"] == model_dirs.a and config["r"] == 4
    assert len(tensors) == 2 * 3 * 2 and adapter_files.digest(tensors) == digest
    full = sum(os.path.getsize(os.path.join(model_dirs.a, f)) for f in os.listdir(model_dirs.a)
               if f.endswith(".safetensors"))
    assert os.path.getsize(os.path.join(path, adapter_files.WEIGHTS)) < full / 4


def test_a_server_merges_the_adapters_bit_for_bit_as_the_trainer_and_reports_their_digest(update, model_dirs):
    engine, path, digest = update
    with running_server(model_dirs.a, max_batch_size=8) as server:
        answer = call(server, lambda c: c.update_weights_from_disk(path, 1, adapter_digest=digest))
        assert answer["adapter_digest"] == digest and server.engine.version == 1
        served = server.engine.model.state_dict()
        for bucket in engine.export_weights(1 << 20):
            for name, tensor in bucket:
                assert torch.equal(served[name], tensor), name
        out = generate_ok(server, {"input_ids": [2, 3, 4], "sampling_params": {"max_new_tokens": 3}})
        assert out["meta_info"]["adapter_digest"] == digest
    # A server started from the adapter directory (a restart in a LoRA run) serves the same weights.
    restarted = GenerationEngine(path, max_batch_size=4)
    try:
        assert restarted.adapter_digest == digest
        state = restarted.model.state_dict()
        assert all(torch.equal(state[n], served[n]) for n in served)
    finally:
        restarted.shutdown()


def damaged_copy(path: str, tmp_path) -> str:
    """The update with one adapter value changed in its file (the file still loads)."""
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "damaged"
    copy.mkdir()
    (copy / adapter_files.CONFIG).write_bytes(open(os.path.join(path, adapter_files.CONFIG), "rb").read())
    tensors = load_file(os.path.join(path, adapter_files.WEIGHTS))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 1e-3
    save_file(tensors, str(copy / adapter_files.WEIGHTS))
    return str(copy)


def test_an_adapter_that_does_not_arrive_as_sent_fails_the_update_naming_server_and_version(update, model_dirs,
                                                                                             tmp_path):
    _, path, digest = update
    damaged = damaged_copy(path, tmp_path)
    (tmp_path / "damaged" / DIGEST).write_text(digest)  # what the trainer sent
    with running_server(model_dirs.a, max_batch_size=8) as server:
        with pytest.raises(GenerationError, match="weight version 1: the server merged adapters of digest .* the "
                                                  "trainer sent .*: the adapter did not arrive as sent"):
            call(server, lambda c: c.update_weights_from_disk(damaged, 1, adapter_digest=digest))

        async def publish() -> None:
            pool = ServerPool([server.url], ["gen_server0"], RolloutConfig())
            try:
                await update_servers(pool, FileChannel("disk", str(tmp_path)), damaged, 2)
            finally:
                await pool.close()

        with pytest.raises(WeightUpdateError) as e:
            asyncio.run(publish())
        assert "weight version 2" in str(e.value) and "gen_server0 refused to load the weights" in str(e.value)
        assert "did not arrive as sent" in str(e.value)
        # A missing adapter file: the server refuses, naming it, and keeps its weights.
        os.remove(os.path.join(damaged, adapter_files.WEIGHTS))
        with pytest.raises(GenerationError, match="adapter_model.safetensors: cannot be read"):
            call(server, lambda c: c.update_weights_from_disk(damaged, 3))
        assert server.engine.version == 2  # the damaged one was merged (and reported); nothing since


def test_adapters_that_do_not_fit_the_served_model_are_refused_by_name(update, model_dirs, tmp_path):
    from safetensors.torch import save_file

    _, path, _ = update
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / adapter_files.CONFIG).write_bytes(open(os.path.join(path, adapter_files.CONFIG), "rb").read())
    save_file({adapter_files.PEFT_PREFIX + "model.layers.9.self_attn.q_proj.lora_A.weight": torch.zeros(4, 32),
               adapter_files.PEFT_PREFIX + "model.layers.9.self_attn.q_proj.lora_B.weight": torch.zeros(32, 4)},
              str(bad / adapter_files.WEIGHTS))
    with running_server(model_dirs.a, max_batch_size=8) as server:
        with pytest.raises(GenerationError, match=r"the served model does not have: \['model.layers.9"):
            call(server, lambda c: c.update_weights_from_disk(str(bad), 1))
        assert server.engine.version != 1


def test_adapters_sent_by_handle_merge_as_from_disk_and_a_damaged_delivery_is_caught(update, model_dirs,
                                                                                      monkeypatch):
    """rollout.weight_update_mode=ipc (shared-memory handles on the CPU): the trainer's export_update
    is the adapters alone in one bucket; the server merges them, bit for bit the trainer's merge, and
    reports their digest; a delivery whose tensors change on the way fails naming server and version."""
    from areal_flow.weights import ipc
    from areal_flow.weights.ipc import IpcSender
    from areal_flow.weights.sender import Server, WeightTransferError

    engine, _, digest = update
    buckets, config = engine.export_update(1 << 20)
    buckets = list(buckets)
    assert len(buckets) == 1 and config == {"r": 4, "lora_alpha": 8.0, "use_rslora": False,
                                            "base_model_name_or_path": model_dirs.a}
    with running_server(model_dirs.a, max_batch_size=8) as server:
        sender = IpcSender([Server("gen_server0", server.url)], timeout=60)
        report = sender.send(buckets, 4, lora_config=config)
        assert report.bytes < 100_000 and server.engine.adapter_digest == digest and server.engine.version == 4
        served = server.engine.model.state_dict()
        assert all(torch.equal(served[n], t) for bucket in engine.export_weights(1 << 20) for n, t in bucket)

        real = ipc.serialize

        def damaged(named):  # one adapter value changed between the trainer and the server
            (name, tensor), *rest = named
            return real([(name, tensor + 1e-3), *rest])

        monkeypatch.setattr(ipc, "serialize", damaged)
        with pytest.raises(WeightTransferError, match=r"weight version 5 .*gen_server0: weight version 5: the server "
                                                      r"merged adapters of digest \w+, the trainer sent \w+"):
            sender.send(buckets, 5, lora_config=config)
        with pytest.raises(WeightTransferError, match="lora_config.r must be a positive integer"):
            sender.send(buckets, 6, lora_config={**config, "r": 0})


def test_each_channel_sends_adapters_to_the_embedded_engine_and_merged_weights_to_real_sglang(update, model_dirs):
    """The channel of a run with real SGLang (whose own LoRA serving is not wired in) sends a
    trainer's merged weights; the embedded engine's gets the adapters alone. Both through the
    trainer ranks' end of the ipc channel, to a real server."""
    from areal_flow.transport.messages import PublishWeights
    from areal_flow.weights.ipc import IpcChannel
    from areal_flow.weights.sender import Server

    engine, _, digest = update
    merged = {n: t for bucket in engine.export_weights(1 << 20) for n, t in bucket}
    size = {True: sum(t.numel() * t.element_size() for b in engine.export_update(1 << 20)[0] for _, t in b),
            False: sum(t.numel() * t.element_size() for t in merged.values())}
    with running_server(model_dirs.a, max_batch_size=8) as server:
        for adapters, version in ((True, 7), (False, 8)):
            channel = IpcChannel([Server("gen_server0", server.url)], adapters=adapters)
            done = channel.send(engine, PublishWeights(version), 0)
            assert done.error == "" and server.engine.version == version
            assert done.bytes == size[adapters]  # the adapters alone, or every weight
            assert server.engine.adapter_digest == (digest if adapters else None)
            served = server.engine.model.state_dict()
            assert all(torch.equal(served[n], t) for n, t in merged.items())
