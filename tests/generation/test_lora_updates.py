"""LoRA weight updates (training.lora): the trainer writes its adapters alone; a real server adds their
low-rank paths to its decode step (generation.lora_decode=lowrank, the served weights stay the base)
or merges them into its fp32 copy of the base, bit for bit as the trainer merges them; it reports
their digest with the update and with every answer, and an adapter that does not arrive as sent
stops the update naming the server and the version."""

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
    with running_server(model_dirs.a, max_batch_size=8, lora_decode="merge") as server:
        answer = call(server, lambda c: c.update_weights_from_disk(path, 1, adapter_digest=digest))
        assert answer["adapter_digest"] == digest and server.engine.version == 1
        served = server.engine.model.state_dict()
        for bucket in engine.export_weights(1 << 20):
            for name, tensor in bucket:
                assert torch.equal(served[name], tensor), name
        out = generate_ok(server, {"input_ids": [2, 3, 4], "sampling_params": {"max_new_tokens": 3}})
        assert out["meta_info"]["adapter_digest"] == digest
    # A server started from the adapter directory (a restart in a LoRA run) serves the same weights.
    restarted = GenerationEngine(path, max_batch_size=4, lora_decode="merge")
    try:
        assert restarted.adapter_digest == digest
        state = restarted.model.state_dict()
        assert all(torch.equal(state[n], served[n]) for n in served)
    finally:
        restarted.shutdown()


def greedy(server) -> tuple[list[int], np.ndarray]:
    out = generate_ok(server, {"input_ids": [2, 3, 4, 9], "return_logprob": True,
                               "sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}})
    logprobs = out["meta_info"]["output_token_logprobs"]
    return [t for _, t, _ in logprobs], np.array([lp for lp, _, _ in logprobs])


def paths_of(engine: GenerationEngine) -> list[tuple[str, torch.Tensor]]:
    return [(f"{i}.{g}.{side}", getattr(p, side)) for i, layer in enumerate(engine._decode_step.lowrank)
            for g, p in sorted(layer.items()) for side in ("a", "b")]


def test_a_server_adds_the_low_rank_path_leaving_the_base_and_answers_as_the_merged_weights(update, model_dirs,
                                                                                           tmp_path):
    """generation.lora_decode=lowrank (the default): the adapters become paths beside the projections,
    the served weights stay the base's, and the answers are the merged weights' (to rounding). A next
    update of the same shapes is copied into the same tensors; full weights drop the paths."""
    from areal_flow.generation.engine.checkpoint import load_checkpoint

    engine, path, digest = update
    base = load_checkpoint(model_dirs.a)
    with running_server(model_dirs.a, max_batch_size=8) as server, \
            running_server(model_dirs.a, max_batch_size=8, lora_decode="merge") as merged:
        assert server.engine.lora_decode == "lowrank" and server.engine._decode_step.lowrank is None
        for s in (server, merged):
            assert call(s, lambda c: c.update_weights_from_disk(path, 1, adapter_digest=digest))["adapter_digest"] == digest
        served = server.engine.model.state_dict()
        assert all(torch.equal(served[n], base[n]) for n in base)  # the base, untouched
        tokens, logprobs = greedy(server)
        tokens_merged, logprobs_merged = greedy(merged)
        assert tokens == tokens_merged and np.abs(logprobs - logprobs_merged).max() < 1e-5
        assert not np.array_equal(logprobs, greedy_of_base(model_dirs.a)[1])  # the adapters are in use
        installed = paths_of(server.engine)
        # Three adapted Linear layers (q, v, gate) of SPEC: the fused q/k/v and gate/up paths of each layer.
        assert sorted({name.split(".")[1] for name, _ in installed}) == ["gate_up", "qkv"]
        before = [t.clone() for _, t in installed]
        damaged = damaged_copy(path, tmp_path)
        call(server, lambda c: c.update_weights_from_disk(damaged, 2))
        after = paths_of(server.engine)
        assert all(x is y for (_, x), (_, y) in zip(installed, after))  # the same tensors, copied into
        assert sum(not torch.equal(b, t) for b, (_, t) in zip(before, after)) == 1  # the one value changed
        call(server, lambda c: c.update_weights_from_disk(model_dirs.a, 3))  # full weights: no paths
        assert server.engine._decode_step.lowrank is None and server.engine.adapter_digest is None
        tokens, logprobs = greedy(server)
        assert tokens == greedy_of_base(model_dirs.a)[0] and np.array_equal(logprobs, greedy_of_base(model_dirs.a)[1])
    restarted = GenerationEngine(path, max_batch_size=4)  # a restart in a LoRA run: the base and the paths
    try:
        assert restarted.adapter_digest == digest
        assert [(n, t.tolist()) for n, t in paths_of(restarted)] == [(n, t.tolist()) for n, t in zip(
            [n for n, _ in installed], before)]
    finally:
        restarted.shutdown()


_BASE_ANSWERS: dict[str, tuple[list[int], np.ndarray]] = {}


def greedy_of_base(model_dir: str) -> tuple[list[int], np.ndarray]:
    if model_dir not in _BASE_ANSWERS:
        with running_server(model_dir, max_batch_size=8) as server:
            _BASE_ANSWERS[model_dir] = greedy(server)
    return _BASE_ANSWERS[model_dir]


def test_adapters_of_a_layer_the_low_rank_path_does_not_compute_are_merged(update, model_dirs, tmp_path):
    """An adapter on lm_head (a target_regex can take it): no decode path computes it, so the
    server merges the update into its weights instead, and says so in its log."""
    from safetensors.torch import save_file

    _, path, _ = update
    head = tmp_path / "head"
    head.mkdir()
    (head / adapter_files.CONFIG).write_bytes(open(os.path.join(path, adapter_files.CONFIG), "rb").read())
    with running_server(model_dirs.a, max_batch_size=8) as server:
        vocab, hidden = server.engine.model.lm_head.weight.shape
        before = server.engine.model.lm_head.weight.clone()
        save_file({adapter_files.PEFT_PREFIX + "lm_head.lora_A.weight": torch.ones(4, hidden) * 0.01,
                   adapter_files.PEFT_PREFIX + "lm_head.lora_B.weight": torch.ones(vocab, 4) * 0.01},
                  str(head / adapter_files.WEIGHTS))
        call(server, lambda c: c.update_weights_from_disk(str(head), 1))
        assert server.engine._decode_step.lowrank is None
        assert torch.allclose(server.engine.model.lm_head.weight, before + 2.0 * 4 * 1e-4)  # alpha/r = 2


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
        with pytest.raises(GenerationError, match="weight version 1: the server applied adapters of digest .* the "
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
    with running_server(model_dirs.a, max_batch_size=8, lora_decode="merge") as server:
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
                                                      r"applied adapters of digest \w+, the trainer sent \w+"):
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
    with running_server(model_dirs.a, max_batch_size=8, lora_decode="merge") as server:
        for adapters, version in ((True, 7), (False, 8)):
            channel = IpcChannel([Server("gen_server0", server.url)], adapters=adapters)
            done = channel.send(engine, PublishWeights(version), 0)
            assert done.error == "" and server.engine.version == version
            assert done.bytes == size[adapters]  # the adapters alone, or every weight
            assert server.engine.adapter_digest == (digest if adapters else None)
            served = server.engine.model.state_dict()
            assert all(torch.equal(served[n], t) for n, t in merged.items())


def test_low_rank_paths_keep_decoding_batch_invariant(update):
    """--enable-deterministic-inference with adapters served as low-rank paths: a seeded request's
    tokens and logprobs are bit-identical alone and in a batch (the paths' matmuls pad their rows
    as the projections' do)."""
    from test_batch_invariance import answers

    _, path, _ = update
    engine = GenerationEngine(path, max_batch_size=16, batch_invariant=True, num_threads=2)
    try:
        assert engine._decode_step.lowrank is not None
        alone = {}
        for i in range(6):
            alone |= answers(engine, [i])
        assert answers(engine, list(range(6))) == alone
        assert answers(engine, [5, 2, 0, 4, 1, 3], join_late=True) == alone
    finally:
        engine.shutdown()


def test_each_answer_carries_its_servers_account_and_a_server_serving_other_adapters_is_caught(update, model_dirs,
                                                                                              tmp_path):
    """Through a real pool and the rollout's requests: every sample says which server answered, at
    which version, with which adapters (messages.Served); a server that loaded damaged adapters
    without the update's check (a restart from damaged files) is named by the controller's check."""
    from areal_flow.controller.adapter_check import AdapterCheck
    from areal_flow.rollout.requests import generate_group
    from areal_flow.transport.messages import GroupMeta, Sample, SampleMeta, Served
    from areal_flow.transport.trajectory import Trajectory

    _, path, digest = update
    damaged = damaged_copy(path, tmp_path)
    check = AdapterCheck()
    check.trained(1, digest)
    check.trained(2, digest)
    with running_server(model_dirs.a, max_batch_size=8) as server:
        async def group(version: int, weights: str) -> GroupMeta:
            pool = ServerPool([server.url], ["gen_server0"], RolloutConfig())
            try:
                await pool.call_each("load", pool.servers, lambda c: c.update_weights_from_disk(weights, version))
                outs = await generate_group(pool, [2, 3, 4], {"max_new_tokens": 4}, 3, f"g{version}")
            finally:
                await pool.close()
            samples = [Sample(uid=f"g{version}-{i}", prompt_id="p", group_id=version, index=i, birth_time=0.0,
                              served=Trajectory.one_turn([2, 3, 4], o).served) for i, o in enumerate(outs)]
            return GroupMeta(version, "reward0", [SampleMeta.of(s, None) for s in samples])

        good = asyncio.run(group(1, path))
        assert [s.served for s in good.samples] == [[Served("gen_server0", 1, digest)]] * 3
        assert check.check(good) is None
        bad = asyncio.run(group(2, damaged))
        problem = check.check(bad)
        assert problem is not None and "generation server gen_server0" in problem and "weight version 2" in problem
        assert bad.samples[0].served[0].adapters not in ("", digest)


def test_a_refused_update_leaves_the_low_rank_path_in_use(update, model_dirs, tmp_path):
    """Adapters that do not fit (lm_head's, of the wrong shape: they would be merged) are refused
    and change nothing: the next update still takes the low-rank path."""
    from safetensors.torch import save_file

    _, path, digest = update
    bad = tmp_path / "bad_head"
    bad.mkdir()
    (bad / adapter_files.CONFIG).write_bytes(open(os.path.join(path, adapter_files.CONFIG), "rb").read())
    save_file({adapter_files.PEFT_PREFIX + "lm_head.lora_A.weight": torch.zeros(4, 3),
               adapter_files.PEFT_PREFIX + "lm_head.lora_B.weight": torch.zeros(5, 4)}, str(bad / adapter_files.WEIGHTS))
    with running_server(model_dirs.a, max_batch_size=8) as server:
        with pytest.raises(GenerationError, match=r"lm_head's adapters make a 5×3 update"):
            call(server, lambda c: c.update_weights_from_disk(str(bad), 1))
        call(server, lambda c: c.update_weights_from_disk(path, 2, adapter_digest=digest))
        assert server.engine._decode_step.lowrank is not None and server.engine.version == 2
