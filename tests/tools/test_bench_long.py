"""tools/bench_long.py on the CPU at the tiny shape with a KV budget too small for its requests:
every request makes all its tokens, rows are preempted and prefilled again, and the table and the
summary line agree."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"

pytestmark = pytest.mark.slow  # a subprocess that builds a model and decodes 1,024 tokens: about 6 s


def test_long_answers_report_tokens_per_s_memory_and_the_preemptions_a_small_budget_causes():
    env = dict(os.environ, COLUMNS="220")
    done = subprocess.run([sys.executable, str(TOOLS / "bench_long.py"), "--shape", "tiny", "--requests", "4",
                           "--new-tokens", "256", "--prompt-tokens", "32", "--max-total-tokens", "700"],
                          capture_output=True, text=True, timeout=240, cwd=TOOLS.parent, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    out = done.stdout
    assert ("command: python tools/bench_long.py --device cpu --shape tiny --requests 4 --prompt-tokens 32 "
            "--new-tokens 256 --max-total-tokens 700") in out
    line = re.search(r"^long answers: ([\d,]+) tokens/s, ([\d.]+) ms a decode step, peak ([\d.]+) GiB, (\d+) "
                     r"preemption\(s\) of (\d+) row\(s\), ([\d,]+) tokens prefilled again$", out, re.M)
    assert line, out
    per_s, step_ms, peak, preemptions, rows, again = line.groups()
    assert int(per_s.replace(",", "")) > 0 and float(step_ms) > 0 and float(peak) > 0
    # 4 × 288 tokens in a 700-token budget: some rows wait, retracted, and are prefilled again with
    # their tokens so far (more than their prompts).
    assert int(preemptions) >= int(rows) >= 1 and int(again.replace(",", "")) > 0
    row = re.search(r"│ +[\d,]+ │ +[\d.]+ │ +700 │ +1,152 │ +[\d.]+ │ +[\d.]+ │ +(\d+) │ +(\d+) │", out)
    assert row and row.groups() == (preemptions, rows), out
