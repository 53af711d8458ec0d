"""The Python example in docs/usage.md runs as written (on the default backend)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

USAGE = Path(__file__).resolve().parents[2] / "docs" / "usage.md"


def test_usage_example_runs(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("EXPERTSTREAM_BACKEND", "sim")
    blocks = re.findall(r"```python\n(.*?)```", USAGE.read_text(), flags=re.S)
    assert len(blocks) == 1
    exec(compile(blocks[0], str(USAGE), "exec"), {"__name__": "usage_example"})
    lines = capsys.readouterr().out.split("\n")
    assert lines[0] == "0 0 fires" and lines[1] == "3 4 fires"
