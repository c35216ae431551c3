"""tools/bench_engine.py on the CPU at a tiny shape: the same code as on a GPU, every engine in one
run, a row per engine and pass with its ratio to the Hugging Face baseline."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"

pytestmark = pytest.mark.slow  # three engines built and timed in a subprocess: about 9 s


def test_one_run_compares_hf_unpacked_the_torch_engine_and_megatron_packed():
    done = subprocess.run([sys.executable, str(TOOLS / "bench_engine.py"), "--device", "cpu", "--shapes", "tiny",
                           "--tokens", "1536", "--micro-batch-tokens", "768", "--row-length", "256", "--repeats", "1"],
                          capture_output=True, text=True, timeout=240, cwd=TOOLS.parent)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = re.findall(r"^\| tiny \| (\w+) \| (logprobs|train step) \| ([\d,]+) \| ([\d.]+|—) \|", done.stdout, re.M)
    assert [(e, p) for e, p, _, _ in rows] == [(e, p) for e in ("hf", "torch", "megatron")
                                               for p in ("logprobs", "train step")]
    assert all(int(tps.replace(",", "")) > 0 for _, _, tps, _ in rows)
    assert {ratio for e, _, _, ratio in rows if e == "hf"} == {"1.00"}
    assert "command: python tools/bench_engine.py --device cpu --shapes tiny" in done.stdout


def test_profile_prints_each_engines_top_ops_its_busy_share_and_its_host_reads():
    done = subprocess.run([sys.executable, str(TOOLS / "bench_engine.py"), "--device", "cpu", "--shapes", "tiny",
                           "--engines", "torch", "--tokens", "1536", "--micro-batch-tokens", "768", "--row-length",
                           "256", "--repeats", "1", "--profile", "--profile-top", "5"],
                          capture_output=True, text=True, timeout=240, cwd=TOOLS.parent)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    section = done.stdout.split("### profile: tiny torch train step\n", 1)[1]
    wall, busy = re.match(r"wall ([\d.]+) ms \(under the profiler\); CPU time in ops ([\d.]+) ms", section).groups()
    assert 0 < float(busy) <= float(wall) * 1.05
    # Two micro-batches: transformers' packed-sequence check once per forward, the engine's reads once per step.
    reads = re.search(r"^(\d+) host reads of tensor values \(synchronisations on a GPU\) in one step; most: (.*)$",
                      section, re.M)
    assert reads and int(reads[1]) == 4 and "transformers.masking_utils x2" in reads[2], section[:500]
    assert "Self CPU" in section and re.search(r"aten::\w+", section)
    assert re.search(r"^\| tiny \| torch \| train step \| [\d,]+ \| — \|", done.stdout, re.M)
    assert "--profile" in done.stdout.split("command: ", 1)[1].splitlines()[0]
