"""tools/bench_generation.py --workload fixed on the CPU at the tiny shape: the same code as the GPU
run (tools/gpu_check.sh), a table row per shape and batch, and the two ratio lines with their targets."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"

pytestmark = pytest.mark.slow  # a subprocess that builds a model and runs both sides: about 9 s


def test_the_fixed_workload_prints_tokens_per_s_and_the_decode_step_against_the_read_floor():
    env = dict(os.environ, COLUMNS="200")  # rich wraps a piped table at 80 columns otherwise
    done = subprocess.run([sys.executable, str(TOOLS / "bench_generation.py"), "--workload", "fixed", "--shapes",
                           "tiny", "--batches", "2", "--new-tokens", "4", "--prompt-tokens", "8", "--repeats", "1"],
                          capture_output=True, text=True, timeout=240, cwd=TOOLS.parent, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    out = done.stdout
    assert ("command: python tools/bench_generation.py --workload fixed --device cpu --shapes tiny --batches 2 "
            "--prompt-tokens 8 --new-tokens 4 --repeats 1") in out
    assert re.search(r"^memory bandwidth: [\d,.]+ GB/s", out, re.M)
    # shape | batch | generate tok/s | engine tok/s | engine / generate | ms/step | KV positions | floor ms | step / floor
    row = re.search(r"│ tiny +│ +2 │ +([\d,]+) │ +([\d,]+) │ +([\d.]+)× │ +([\d.]+) │ +([\d,]+) │ +([\d.]+) │ +([\d.]+)× │",
                    out)
    assert row, out
    generate, engine, speedup, step_ms, kv, floor_ms, over = row.groups()
    assert int(generate.replace(",", "")) > 0 and int(engine.replace(",", "")) > 0
    assert float(step_ms) > 0 and float(floor_ms) > 0
    # KV positions a step reads: at most 2 rows of 8 prompt tokens and up to 4 new ones (rows may join apart).
    assert 0 < int(kv.replace(",", "")) <= 2 * 12
    line = re.search(r"^tiny, batch 2: engine vs generate: ([\d.]+)×; engine decode step vs read floor: "
                     r"([\d.]+) / ([\d.]+) ms = ([\d.]+)× \(target ≤ 3×; (\d+) decode steps\)$", out, re.M)
    assert line, out
    assert line.group(1) == speedup and line.group(4) == over and int(line.group(5)) >= 4
    assert "engine ≥ 10× generate, is for batch 256 on the 0.5b shape: not run here" in out
    # The step's host/device split (generation/engine/step_timing.py): its parts add up to the step; on
    # the CPU no CUDA events nor graphs.
    split = re.search(r"^tiny, batch 2: engine step split, mean ms over (\d+) pure decode steps: host ([\d.]+) \+ "
                      r"forward call ([\d.]+) \+ sampling call ([\d.]+) \+ readback ([\d.]+) = ([\d.]+); "
                      r"loop between steps ([\d.]+)$", out, re.M)
    assert split, out
    steps, *parts, wall, _ = split.groups()
    assert 1 <= int(steps) <= int(line.group(5)) and float(parts[0]) > 0 and float(parts[1]) > 0
    assert sum(map(float, parts)) == pytest.approx(float(wall), abs=0.003)
    # The overlap schedule against the same engine without it, in the same run.
    overlap = re.search(r"^tiny, batch 2: overlap schedule: decode step ([\d.]+) ms against ([\d.]+) without "
                        r"\(--disable-overlap-schedule\): ([\d.]+)× faster$", out, re.M)
    assert overlap, out
    assert overlap.group(1) == line.group(2) and float(overlap.group(2)) > 0
    assert float(overlap.group(3)) == pytest.approx(float(overlap.group(2)) / float(overlap.group(1)), rel=0.02)
