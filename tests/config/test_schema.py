import dataclasses
import subprocess
import sys
from pathlib import Path

from areal_flow.config.schema import RunConfig

REPO = Path(__file__).resolve().parents[2]


def test_every_field_has_one_line_of_help():
    import typing

    def walk(cls):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            yield cls.__name__, f
            if dataclasses.is_dataclass(hints[f.name]):
                yield from walk(hints[f.name])

    missing = [f"{owner}.{f.name}" for owner, f in walk(RunConfig) if not f.metadata.get("help")]
    assert not missing
    assert any(f.name == "rollout" for _, f in walk(RunConfig))


def test_the_committed_config_reference_is_current():
    out = subprocess.run([sys.executable, str(REPO / "tools" / "config_reference.py")], capture_output=True,
                         text=True, check=True).stdout
    assert out == (REPO / "docs" / "config.md").read_text(), "run: python tools/config_reference.py > docs/config.md"
