"""`expertstream plot` draws results and traces headless, and says how to install matplotlib."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from expertstream.cli import main

SIZE = (900, 500)


def _png(path: Path) -> tuple[tuple[int, int], int]:
    image = pytest.importorskip("matplotlib.image").imread(path)
    colours = {tuple(px) for px in image.reshape(-1, image.shape[-1])[::7].tolist()}
    return (image.shape[1], image.shape[0]), len(colours)


@pytest.fixture(scope="module")
def results_and_trace(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("plot")
    results, trace = folder / "results.json", folder / "trace.json"
    argv = ["prefill", str(tiny_path), "--backend", "sim", "-p", "32", "-ub", "8,16", "--slots", "0,3", "-r", "2"]
    out = sys.stdout
    with open(results, "w") as f:
        sys.stdout = f
        try:
            assert main([*argv, "-o", "json", "--trace", str(trace)]) == 0
        finally:
            sys.stdout = out
    return results, trace


@pytest.mark.parametrize("which", [0, 1], ids=["results", "trace"])
def test_plot_writes_a_png_of_the_asked_size(
    which: int, results_and_trace: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "out.png"
    assert main(["plot", str(results_and_trace[which]), "-o", str(png), "--size", "x".join(map(str, SIZE))]) == 0
    size, colours = _png(png)
    assert size == SIZE and colours > 8, "a blank or one-colour picture"


def test_plot_without_matplotlib_says_how_to_install(
    results_and_trace: tuple[Path, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["plot", str(results_and_trace[0]), "-o", str(tmp_path / "x.png")]) == 2
    assert "pip install 'expertstream[plot]'" in capsys.readouterr().err
