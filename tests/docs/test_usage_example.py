"""The Python examples in docs/usage.md run as written.

The first (a whole model: logits and greedy text), the second (host memory disk) and the third
(scheduler and kernels) run here on the simulator; the fourth (torch) runs in
tests/interop/test_programs.py on every backend torch can reach.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

USAGE = Path(__file__).resolve().parents[2] / "docs" / "usage.md"


def usage_blocks() -> list[str]:
    """The ```python blocks of docs/usage.md, in order."""
    return re.findall(r"```python\n(.*?)```", USAGE.read_text(), flags=re.S)


def test_usage_example_runs(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("EXPERTSTREAM_BACKEND", "sim")
    blocks = usage_blocks()
    assert len(blocks) == 4
    exec(compile(blocks[0], str(USAGE), "exec"), {"__name__": "usage_model"})
    text = capsys.readouterr().out.strip()
    assert text.startswith(("'", '"')) and len(text) > 2  # the repr of the generated text, not empty
    exec(compile(blocks[1], str(USAGE), "exec"), {"__name__": "usage_disk"})
    mode, shape = capsys.readouterr().out.split("\n")[:2]
    assert mode == "disk" and shape.startswith("(") and shape.endswith(")")
    exec(compile(blocks[2], str(USAGE), "exec"), {"__name__": "usage_example"})
    lines = capsys.readouterr().out.split("\n")
    assert lines[0] == "0 0 fires" and lines[1] == "3 4 fires"
