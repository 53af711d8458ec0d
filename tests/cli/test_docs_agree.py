"""What the README, nox and --help say a run takes agrees with the figures measured in docs/results."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from expertstream.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _measured(document: str, pattern: str) -> tuple[str, ...]:
    found = re.search(pattern, (ROOT / "docs" / "results" / document).read_text(encoding="utf-8"), re.MULTILINE)
    assert found is not None, f"{document} no longer says {pattern!r}"
    return found.groups()


def _help(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    return " ".join(capsys.readouterr().out.split())


def test_the_mutation_run_takes_what_reliability_md_measured() -> None:
    (minutes,) = _measured("reliability.md", r"A full run took ([\d.]+) minutes")
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    nox = " ".join((ROOT / "noxfile.py").read_text(encoding="utf-8").split())
    assert f"mutation` runs mutmut on `scheduler/` and the hazard checker ({minutes} minutes" in readme
    assert f"A full run took {minutes} minutes" in nox and "an hour" not in nox


def test_tune_takes_what_predict_h200_md_measured(capsys: pytest.CaptureFixture[str]) -> None:
    fresh, cached = _measured("predict-h200.md", r"`tune` on the H200: (\d+) s in a fresh process, (\d+) s with")
    warm, first = _measured(
        "predict-h200.md", r"^\| \*\*total, s\*\* \| \*\*[\d.]+\*\* \| \*\*([\d.]+)\*\*.*\*\*([\d.]+)\*\* \|$"
    )
    with_model = f"{round(float(warm))}-{round(float(first))} s"
    assert f"on the H200: {cached}-{fresh} s, {with_model} with a 48-layer model" in _help(capsys)
    assert f"tune first, {with_model} on the H200 with a 48-layer model" in _help(capsys, "prefill")
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert f"in {round(float(warm))} s on the H200 with a 48-layer model, {round(float(first))} s where" in readme
