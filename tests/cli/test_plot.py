"""`expertstream plot` draws results and traces headless, and says how to install matplotlib."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

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


def _kernel_pixels(png: Path) -> int:
    """Pixels of the timeline's kernel colour (#2ca02c)."""
    image = pytest.importorskip("matplotlib.image").imread(png)[..., :3]
    return int((abs(image - [0x2C / 255, 0xA0 / 255, 0x2C / 255]).max(axis=-1) < 0.02).sum())


def test_the_timeline_shows_kernels_and_what_ran_them(
    results_and_trace: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plt = pytest.importorskip("matplotlib.pyplot")
    titles: list[str] = []
    save = plt.Figure.savefig

    def recording(fig: Any, *args: Any, **kwargs: Any) -> None:
        titles.extend(ax.get_title() for ax in fig.axes)
        save(fig, *args, **kwargs)

    monkeypatch.setattr(plt.Figure, "savefig", recording)
    png = tmp_path / "timeline.png"
    assert main(["plot", str(results_and_trace[1]), "-o", str(png)]) == 0
    # the tiny model's kernels last far less than a pixel of the run; they must still show
    assert _kernel_pixels(png) > 500
    assert "simulated NVIDIA H200 (profile cuda-h200; virtual time, with data)" in titles[0]
    assert "tiny: qwen3moe, 2 layers, 8 experts, Q4_0" in titles[0]


def _run(model: str, layers: int, timing_only: bool, compute_only: float) -> dict[str, Any]:
    rows = [
        {"tokens": 4096, "ubatch": 2048, "slots": slots, "host_memory": "registered", "prefill_tokens_per_s": rate}
        | {"compute_only_tokens_per_s": compute_only, "transfer_floor_tokens_per_s": 41_000.0}
        for slots, rate in ((0, 35_000.0), (3, 40_000.0))
    ]
    model_doc = {"path": f"/tmp/x/{model}.gguf", "arch": "qwen3moe", "n_layer": layers, "n_expert": 128}
    return {
        "backend": "sim",
        "device": "NVIDIA H200",
        "profile": "cuda-h200",
        "timing_only": timing_only,
        "model": model_doc | {"expert_type": "Q4_0", "expert_bytes": layers * 340_000_000},
        "rows": rows,
    }


def test_results_of_two_models_get_a_panel_each_that_the_rows_fill(tmp_path: Path) -> None:
    plt = pytest.importorskip("matplotlib.pyplot")
    from expertstream.cli.plot import _results

    fig = plt.figure()
    try:
        _results(fig, [_run("qwen3-30b-a3b-Q4_0", 8, True, 236_000.0), _run("tiny-Q4_0", 2, False, 32_000.0)])
        panels = [ax for ax in fig.axes if ax.get_title()]
        titles = [" ".join(ax.get_title().split()) for ax in panels]
        assert len(panels) == 2
        assert titles[0].startswith("qwen3-30b-a3b-Q4_0: qwen3moe, 8 layers, 128 experts, Q4_0")
        assert titles[1].startswith("tiny-Q4_0: qwen3moe, 2 layers, 128 experts, Q4_0")
        assert "simulated NVIDIA H200 (profile cuda-h200; virtual time, no data)" in titles[0]
        assert "virtual time, with data" in titles[1]
        # compute only (236,000) would squash rows of 35-40,000 t/s: marked at the top with its value instead
        top = panels[0].get_ylim()[1]
        assert top < 2 * 40_000 and any(t.get_text() == "236,000 t/s" for t in panels[0].texts)
        assert panels[1].get_ylim()[1] >= 41_000  # references near the rows stay lines on the scale
    finally:
        plt.close(fig)
