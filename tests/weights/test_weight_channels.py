"""The weight channels as the config chooses them, and the pieces of each that need no server."""

import base64
import os
import pickle

import pytest
import torch

from areal_flow.config.schema import ClusterConfig, GenerationConfig, RolloutConfig, RunConfig
from areal_flow.runtime.spec import RunSpec
from areal_flow.weights import make_channel
from areal_flow.weights.broadcast import BroadcastChannel
from areal_flow.weights.files import FileChannel, prune
from areal_flow.weights.ipc import IpcChannel, deserialize, serialize
from areal_flow.weights.sender import WeightSender

URLS = ["http://127.0.0.1:1", "http://127.0.0.1:2"]


def spec(**fields) -> RunSpec:
    return RunSpec(run_dir="/run", model_path="/m", train_path="", eval_path="", gen_ports=[1, 2], controller_port=0,
                   rollout_ports=[], trainer_ports=[0], dist_port=0, n_trainers=1, n_rollout=1, **fields)


def channel(mode: str, device_type: str = "cpu", backend: str = "embedded", **spec_fields):
    cfg = RunConfig(rollout=RolloutConfig(weight_update_mode=mode, weight_bucket_mb=3),
                    cluster=ClusterConfig(device_type=device_type), generation=GenerationConfig(backend=backend, tp_size=2))
    return make_channel(cfg, spec(**spec_fields))


def test_each_mode_makes_its_channel_once_with_what_it_needs():
    disk, shm = channel("disk"), channel("shm", weights_dir="/dev/shm/areal_flow-x")
    assert isinstance(disk, FileChannel) and disk.root == "/run/weights" and disk.overlaps_training
    assert isinstance(shm, FileChannel) and shm.root == "/dev/shm/areal_flow-x"
    gloo, nccl = channel("distributed"), channel("distributed", device_type="cuda", hosts={"trainer0": "10.0.0.2"})
    assert isinstance(gloo, BroadcastChannel) and gloo.backend == "gloo" and not gloo.overlaps_training
    assert (nccl.backend, nccl.master_address, nccl.bucket_bytes) == ("nccl", "10.0.0.2", 3 << 20)
    ipc = channel("ipc")
    assert isinstance(ipc, IpcChannel) and ipc.sent_by_trainers and ipc.every_server
    # LoRA: the embedded servers merge adapters; real SGLang gets whole (merged) models from disk.
    assert disk.adapters and not channel("disk", backend="sglang").adapters


def test_the_weights_group_gives_a_real_sglang_server_one_rank_per_tp_rank():
    """SGLang's TP ranks each join the group (rank_offset + tp_rank); the embedded engine, whose
    tp_size is its torch threads, is one rank. Offsets follow from that."""
    for backend, ranks, offsets, world in (("sglang", 2, [1, 3], 5), ("embedded", 1, [1, 2], 3)):
        servers = channel("distributed", backend=backend).servers
        assert [(s.name, s.url, s.ranks) for s in servers] == [("gen_server0", URLS[0], ranks),
                                                                ("gen_server1", URLS[1], ranks)]
        sender = WeightSender(servers)
        assert (sender.rank_offsets, sender.world_size) == (offsets, world)


def test_published_weights_are_pruned_to_the_last_two_and_every_kept_version(tmp_path):
    for v in range(1, 13):
        (tmp_path / f"v{v}").mkdir()
    (tmp_path / "notes").mkdir()  # not a version: left alone
    prune(str(tmp_path), keep=12, every=5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "v10", "v11", "v12", "v5"]
    prune(str(tmp_path), keep=12)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "v11", "v12"]


def test_a_bucket_serialized_as_handles_reads_back_as_the_same_tensors_without_carrying_their_bytes():
    bucket = [("a", torch.randn(3, 4)), ("b", torch.arange(5, dtype=torch.bfloat16))]
    text, alive = serialize(bucket)
    assert len(text) < 2000  # names and handles, not the data
    back = deserialize(text)
    assert [n for n, _ in back] == ["a", "b"]
    for (_, sent), (_, got) in zip(bucket, back):
        assert got.dtype == sent.dtype and torch.equal(got, sent)
    alive[0].add_(1.0)  # the same shared memory: what the sender's copy holds, the reader sees
    assert torch.equal(back[0][1], alive[0]) and not torch.equal(back[0][1], bucket[0][1])


class Evil:
    def __reduce__(self):
        return os.system, ("echo pwned",)


@pytest.mark.parametrize("text, message", [
    (base64.b64encode(pickle.dumps([("w", Evil())])).decode(), "a serialized tensor may not name posix.system"),
    ("not base64!", "does not decode"),
    (base64.b64encode(pickle.dumps({"w": 1})).decode(), "must be a list of (name, tensor) pairs"),
    (17, "must be a base64 string, got int"),
])
def test_a_serialized_bucket_that_is_not_tensor_handles_is_refused_naming_why(text, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        deserialize(text)


def test_a_restarted_server_starts_from_the_last_loaded_version_or_the_next_one_kept_when_it_was_pruned(tmp_path):
    from areal_flow.weights.files import last_loaded, prune, record_loaded

    root = tmp_path / "weights"
    first = ("/start", 0)
    assert last_loaded(str(tmp_path), first) == first  # nothing loaded yet
    for v in (4, 5):
        (root / f"v{v}").mkdir(parents=True)
    record_loaded(str(tmp_path), str(root / "v4"), 4)
    assert last_loaded(str(tmp_path), first) == (str(root / "v4"), 4)
    (root / "v6").mkdir()  # trainer rank 0 wrote version 6 while the servers loaded version 5: v4 pruned
    prune(str(root), keep=6)
    assert last_loaded(str(tmp_path), first) == (str(root / "v5"), 5)
