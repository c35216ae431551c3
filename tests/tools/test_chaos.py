"""tools/chaos.py, short: random kill -9s of a run's processes; the run restarts itself from its
checkpoints and its ledger audit passes: no group lost, none trained twice, none too stale."""

import sys
from pathlib import Path

import pytest
from rich.console import Console
from run_helpers import leftover_processes

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import chaos  # noqa: E402

pytestmark = pytest.mark.slow


def test_random_kills_lose_and_duplicate_nothing(tmp_path, run_cache):
    run_dir = tmp_path / "run"
    # Two kills must land before the run ends: a kill every 0.5-1.5 s once the first checkpoint
    # exists (every 1-2 s, a run of 20 steps once ended after the first).
    steps = 20
    figures = chaos.chaos(str(run_dir), kills=2, steps=steps, seed=3, every=(0.5, 1.5),
                          overrides=[f"cache_dir={run_cache}", "model.bootstrap_steps=30"], timeout=300,
                          console=Console(quiet=True))
    out = (run_dir / "launcher.out").read_text()
    assert figures["launcher_exit"] == 0, out[-3000:]
    # Each kill is survived: the process restarted alone (a worker), or the run from its checkpoint.
    assert figures["kills"] == 2 and figures["restarted_alone"] + figures["restarts"] >= 1, (figures, out[-3000:])
    audit = figures["audit"]
    assert audit["problems"] == [] and audit["steps"] == steps
    assert figures["staleness_max"] <= figures["eta"]  # the tokens' versions too, across every restart
    assert audit["trained"] == steps * 2 and audit["admitted"] == audit["trained"] + audit["pending"]
    assert not leftover_processes(run_dir)
