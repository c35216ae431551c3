"""The CPU paged decode-attention kernel (generation/engine/cpu_decode.py): against the plain-torch
reference on rows whose blocks lie out of order (garbage in block 0 and past each row's length must
not leak in), bit for bit alone and in any batch, the same split over threads, refused inputs named,
and the engine's torch path where no compiler builds it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from generation_helpers import build_model, torch_threads
from paged_cases import make_case, reference

from areal_flow.generation.engine import cpu_decode

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason="no C compiler on this machine")

CASES = [  # lengths, shape
    ([1, 4, 13, 16, 40], dict(kv_heads=2, group=2, head_dim=16, block_size=4)),
    ([16, 33, 7, 32, 1], dict(kv_heads=2, group=3, head_dim=32, block_size=16)),
    ([25, 2, 17, 40, 9, 64, 65], dict(kv_heads=1, group=1, head_dim=40, block_size=1)),
    ([300, 129, 31, 700], dict(kv_heads=4, group=4, head_dim=64, block_size=16)),  # several tiles a row
]


@pytest.mark.parametrize("seed", range(len(CASES)))
def test_the_kernel_gives_the_reference_attention_reading_only_each_rows_blocks(seed):
    lengths, shape = CASES[seed]
    q, keys, values, table, lens = make_case(lengths, seed=seed, **shape)
    scale = shape["head_dim"] ** -0.5
    got = cpu_decode.paged_decode_attention(q, keys, values, table, lens, shape["block_size"], scale)
    want = reference(q, keys, values, table, lens, shape["block_size"], scale)
    assert got.shape == want.shape and torch.isfinite(got).all()  # no garbage read (it would be ±1e4)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_rows_result_is_bit_identical_alone_and_in_any_batch():
    lengths, shape = [300, 129, 31, 700, 5, 48], dict(kv_heads=2, group=3, head_dim=32, block_size=16)
    q, keys, values, table, lens = make_case(lengths, seed=7, **shape)
    batched = cpu_decode.paged_decode_attention(q, keys, values, table, lens, 16, 0.2)
    for r in range(len(lengths)):
        alone = cpu_decode.paged_decode_attention(q[r:r + 1], keys, values, table[r:r + 1], lens[r:r + 1], 16, 0.2)
        assert torch.equal(alone[0], batched[r])
    order = [3, 0, 5, 1, 4, 2]
    shuffled = cpu_decode.paged_decode_attention(q[order], keys, values, table[order], lens[order], 16, 0.2)
    assert torch.equal(shuffled, batched[order])


def test_rows_split_over_threads_give_the_same_bits():
    lengths = [40 + 37 * i for i in range(24)]
    q, keys, values, table, lens = make_case(lengths, seed=3, kv_heads=2, group=3, head_dim=32, block_size=16)
    with torch_threads(1):
        one = cpu_decode.paged_decode_attention(q, keys, values, table, lens, 16, 0.2)
    with torch_threads(2):
        two = cpu_decode.paged_decode_attention(q, keys, values, table, lens, 16, 0.2)
    assert torch.equal(one, two)


def test_inputs_it_cannot_take_are_refused_by_name():
    q, keys, values, table, lens = make_case([4, 9], seed=0, kv_heads=2, group=2, head_dim=16, block_size=4)
    with pytest.raises(ValueError, match="float32 CPU tensors.*torch.float64"):
        cpu_decode.paged_decode_attention(q.double(), keys.double(), values.double(), table, lens, 4, 0.25)
    with pytest.raises(ValueError, match="heads a multiple of kv_heads"):
        cpu_decode.paged_decode_attention(q[:, :3], keys, values, table, lens, 4, 0.25)


def test_the_engines_forward_uses_it_on_the_cpu_and_gives_the_torch_paths_logits():
    from areal_flow.generation.engine.decode import DecodeStep

    step = DecodeStep(build_model(0).eval())
    assert step.cpu_kernel and not step.paged_kernel
    step64 = DecodeStep(build_model(0).eval().double())
    assert not step64.cpu_kernel  # float64 keeps the torch path


def test_without_a_compiler_the_engine_keeps_the_torch_path_and_says_why(tmp_path):
    # A fresh process: the build is cached per process. No compiler ($CC missing, cc/gcc off PATH),
    # and an empty kernel cache so nothing built before is found.
    script = textwrap.dedent("""
        import logging, torch
        logging.basicConfig(level=logging.WARNING)
        from areal_flow.generation.engine import cpu_decode
        assert not cpu_decode.available()
        from generation_helpers import build_model
        from areal_flow.generation.engine.decode import DecodeStep
        assert not DecodeStep(build_model(0).eval()).cpu_kernel
        print("torch path")
    """)
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc"), "AREAL_FLOW_CACHE": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "torch path" in done.stdout
    assert "building the CPU decode-attention kernel" in done.stderr and "no-such-cc" in done.stderr


def test_loading_the_kernel_leaves_the_processs_floating_point_state_alone(tmp_path):
    # (A library built with -ffast-math turns on flush-to-zero for the whole process when loaded.)
    script = textwrap.dedent("""
        import numpy as np, torch
        from areal_flow.generation.engine import cpu_decode
        assert cpu_decode.available()
        tiny = np.float32(1e-40)  # a subnormal float32
        assert tiny * np.float32(1.0) != 0 and float(torch.tensor(1e-40) * 1.0) != 0, "subnormals flushed to zero"
    """)
    env = {**os.environ, "AREAL_FLOW_CACHE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_the_build_is_cached_and_reused_by_a_new_process(tmp_path):
    env = {**os.environ, "AREAL_FLOW_CACHE": str(tmp_path)}
    script = "from areal_flow.generation.engine import cpu_decode; assert cpu_decode.available()"
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=120)
    (built,) = (tmp_path / "kernels").glob("paged_decode_*.so")
    stamp = built.stat().st_mtime_ns
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=120)
    assert [p.name for p in (tmp_path / "kernels").iterdir()] == [built.name]  # no leftover build folder
    assert built.stat().st_mtime_ns == stamp
