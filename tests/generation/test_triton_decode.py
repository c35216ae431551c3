"""The Triton paged decode-attention kernel (generation/engine/triton_decode.py) against a plain torch
reference: on the CPU through Triton's interpreter (in a subprocess, since TRITON_INTERPRET must be set
before the kernels are jitted: this file run as a script), and on a GPU in fp32, bf16 and inside a
CUDA graph replayed with new lengths and tables."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from paged_cases import GARBAGE, make_case, reference

ROOT = Path(__file__).resolve().parents[2]
MODULE = ROOT / "areal_flow" / "generation" / "engine" / "triton_decode.py"


def interpreter_checks() -> int:
    """Run with TRITON_INTERPRET=1 (the subprocess of the test below); raises on a mismatch."""
    from areal_flow.generation.engine.triton_decode import available, paged_decode_attention

    assert available("cpu")
    checked = 0
    cases = [  # lengths, shape, the (splits, tile) to try
        ([1, 4, 13, 16, 40], dict(kv_heads=2, group=2, head_dim=16, block_size=4),
         [(1, None), (1, 16), (2, 16), (3, 16)]),
        ([16, 0, 33, 7, 32], dict(kv_heads=2, group=3, head_dim=8, block_size=16), [(1, None), (4, 16)]),
        ([25, 2, 17, 40, 9], dict(kv_heads=2, group=1, head_dim=16, block_size=16), [(1, 16), (2, 32)]),
    ]
    for seed, (lengths, shape, runs) in enumerate(cases):
        q, keys, values, table, lens = make_case(lengths, seed=seed, **shape)
        scale = shape["head_dim"] ** -0.5
        want = reference(q, keys, values, table, lens, shape["block_size"], scale)
        for splits, tile in runs:
            got = paged_decode_attention(q, keys, values, table, lens, shape["block_size"], scale,
                                         splits=splits, tile=tile)
            assert got.shape == q.shape and got.dtype == q.dtype
            err = (got - want).abs().max().item()
            assert err < 1e-5, f"lengths {lengths} {shape} splits={splits} tile={tile}: max error {err}"
            checked += 1
    # A query that is a strided view (as q is, sliced out of the fused qkv projection) and new
    # lengths and block tables written into the same tensors between calls.
    q, keys, values, table, lens = make_case([5, 12, 3], kv_heads=2, group=2, head_dim=16, block_size=4, seed=7)
    qkv = torch.cat([q, torch.full((3, 4, 16), GARBAGE)], dim=1)
    got = paged_decode_attention(qkv[:, :4], keys, values, table, lens, 4, 0.25)
    assert (got - reference(q, keys, values, table, lens, 4, 0.25)).abs().max().item() < 1e-5
    lens.copy_(torch.tensor([2, 9, 1]))
    table.copy_(table.flip(0))
    got = paged_decode_attention(qkv[:, :4], keys, values, table, lens, 4, 0.25, splits=2, tile=16)
    assert (got - reference(q, keys, values, table, lens, 4, 0.25)).abs().max().item() < 1e-5
    return checked + 2


@pytest.mark.slow  # the interpreter takes ~10 s
def test_the_kernel_matches_the_reference_in_the_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, __file__], env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert done.stdout.split()[-2:] == ["checked", "10"], done.stdout[-2000:]


def test_the_module_imports_without_triton(monkeypatch):
    """CI machines may lack triton: the module still imports, says it is unavailable and refuses."""
    for name in ("triton", "triton.language"):
        monkeypatch.setitem(sys.modules, name, None)  # `import triton` now raises ImportError
    spec = importlib.util.spec_from_file_location("triton_decode_without_triton", MODULE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert not module.available("cpu") and not module.available("cuda")
    q, keys, values, table, lengths = make_case([3], kv_heads=1, group=1, head_dim=8, block_size=4, seed=0)
    with pytest.raises(RuntimeError, match="needs triton"):
        module.paged_decode_attention(q, keys, values, table, lengths, 4, 1.0)


def test_availability_follows_the_device_and_the_interpreter():
    pytest.importorskip("triton")
    from areal_flow.generation.engine import triton_decode

    assert triton_decode.available("cuda")
    assert triton_decode.available("cpu") == (os.environ.get("TRITON_INTERPRET") == "1")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_on_the_gpu_it_matches_the_reference(dtype, tolerance):
    pytest.importorskip("triton")
    from areal_flow.generation.engine.triton_decode import paged_decode_attention

    cases = [
        ([1, 4, 13, 16, 40], dict(kv_heads=2, group=3, head_dim=16, block_size=4)),
        ([1, 16, 300, 1000, 2049, 77], dict(kv_heads=2, group=8, head_dim=128, block_size=16)),
        ([5, 128, 512], dict(kv_heads=4, group=1, head_dim=64, block_size=16)),
        ([3, 700], dict(kv_heads=1, group=7, head_dim=80, block_size=32)),
    ]
    for seed, (lengths, shape) in enumerate(cases):
        q, keys, values, table, lens = make_case(lengths, seed=seed, dtype=dtype, device="cuda", **shape)
        scale = shape["head_dim"] ** -0.5
        want = reference(q, keys, values, table, lens, shape["block_size"], scale)
        for splits in (None, 1, 4):
            got = paged_decode_attention(q, keys, values, table, lens, shape["block_size"], scale, splits=splits)
            assert got.dtype == dtype
            torch.testing.assert_close(got.float(), want, atol=tolerance, rtol=tolerance,
                                       msg=lambda m: f"{lengths} {shape} {dtype} splits={splits}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [None, 1])
def test_on_the_gpu_a_captured_graph_replays_with_new_lengths(splits):
    pytest.importorskip("triton")
    from areal_flow.generation.engine.triton_decode import paged_decode_attention

    shape = dict(kv_heads=2, group=4, head_dim=128, block_size=16)
    lengths = [40, 1, 700, 256]
    q, keys, values, table, lens = make_case(lengths, seed=3, dtype=torch.bfloat16, device="cuda",
                                             spare_columns=20, spare_blocks=40, **shape)
    scale = 128 ** -0.5
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the capture
        paged_decode_attention(q, keys, values, table, lens, 16, scale, splits=splits)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode_attention(q, keys, values, table, lens, 16, scale, splits=splits)
    width, num_blocks = table.shape[1], keys.shape[1] // 16
    gen = torch.Generator().manual_seed(0)
    for new in ([40, 1, 700, 256], [41, 17, 1, 999], [width * 16, 0, 16, 5]):
        # written in place: new lengths, tables (any blocks but 0), queries and pool contents
        lens.copy_(torch.tensor(new))
        table.copy_(torch.randint(1, num_blocks, table.shape, generator=gen))
        q.copy_(torch.randn(q.shape, generator=gen))
        keys[:, 16:].copy_(torch.randn(keys[:, 16:].shape, generator=gen))
        values[:, 16:].copy_(torch.randn(values[:, 16:].shape, generator=gen))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), reference(q, keys, values, table, lens, 16, scale),
                                   atol=2e-2, rtol=2e-2, msg=lambda m: f"lengths {new}: {m}")


if __name__ == "__main__":  # the interpreter checks, in a process started with TRITON_INTERPRET=1
    print("checked", interpreter_checks())
