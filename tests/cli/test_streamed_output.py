"""prefill prints rows as each group finishes, keeps them on Ctrl-C, and reports progress on stderr."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

import pytest

import expertstream.cli.prefill as prefill_command
from expertstream.bench.measure import Settings
from expertstream.cli.estimate import ExpertCost, numpy_seconds
from expertstream.cli.tools import RunProgress
from expertstream.engine.runner import Batching
from expertstream.hostmem import HostMemoryMode
from expertstream.model import MoeModel

from . import run_main as _run

TWO_GROUPS = ["-p", "16,32", "-ub", "16", "--slots", "0,3", "-r", "1", "--backend", "sim"]


def _interrupt_after_the_first_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C as the second group of rows enqueues its first step."""
    step = RunProgress.step

    def interrupting(self: RunProgress, what: str) -> None:
        if self.rows_done:
            raise KeyboardInterrupt
        step(self, what)

    monkeypatch.setattr(RunProgress, "step", interrupting)


@pytest.mark.parametrize("fmt", ["text", "md", "csv", "jsonl", "json"])
def test_ctrl_c_keeps_the_rows_already_measured(
    fmt: str, tiny_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _interrupt_after_the_first_group(monkeypatch)
    code, out, err = _run(capsys, "bench", "-m", str(tiny_path), *TWO_GROUPS, "-o", fmt)
    assert code == 130 and "interrupted" in err
    lines = out.strip().splitlines()
    if fmt == "json":
        doc = json.loads(out)
        assert doc["interrupted"] is True and [(r["tokens"], r["slots"]) for r in doc["rows"]] == [(16, 0), (16, 3)]
    elif fmt == "jsonl":
        assert [(json.loads(line)["tokens"], json.loads(line)["slots"]) for line in lines] == [(16, 0), (16, 3)]
    elif fmt == "csv":
        assert lines[0].startswith("slots,") and [line.split(",")[:3] for line in lines[1:]] == [
            ["0", "registered", "16"],
            ["3", "registered", "16"],
        ]
    elif fmt == "md":
        assert lines[0].startswith("| slots |") and len(lines) == 4
    else:
        rows = [line.split() for line in lines if line.split()[:1] in (["0"], ["3"])]
        assert [row[0] for row in rows] == ["0", "3"]
        assert "16 tokens in ubatches of 16" in out and "32 tokens" not in out


def test_rows_reach_stdout_before_the_next_group_runs(
    tiny_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    printed_before: list[str] = []
    measure = prefill_command.measure

    def recording(*args: Any, **kwargs: Any) -> Any:
        printed_before.append(capsys.readouterr().out)
        return measure(*args, **kwargs)

    monkeypatch.setattr(prefill_command, "measure", recording)
    code, out, _ = _run(capsys, "bench", "-m", str(tiny_path), *TWO_GROUPS, "-o", "csv")
    assert code == 0
    header, first, second = printed_before[1].splitlines()
    assert header.startswith("slots,") and first.startswith("0,registered,16,") and second.startswith("3,")
    assert [line.split(",")[2] for line in out.splitlines()] == ["32", "32"]


def test_progress_lines_on_stderr_when_it_is_no_terminal(tiny_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "bench", "-m", str(tiny_path), *TWO_GROUPS, "-p", "16,32,48", "-o", "json")
    assert code == 0 and len(json.loads(out)["rows"]) == 6
    progress = [line for line in err.splitlines() if line.startswith("prefill: ")]
    assert [line.split(",")[0] for line in progress] == ["prefill: 2/6 rows", "prefill: 4/6 rows"]
    assert all(line.endswith(" left") and ", about " in line for line in progress)


def test_a_long_group_says_where_it_is_every_so_often(capsys: pytest.CaptureFixture[str]) -> None:
    now = [0.0]
    progress = RunProgress("prefill", steps=10, rows=2, every_s=60.0, clock=lambda: now[0], terminal=False)
    for _ in range(5):
        now[0] += 10.0
        progress.step("ubatch")
    now[0] += 20.0  # 70 s in, 6 of 10 steps done
    progress.step("ubatch")
    progress.step("ubatch")  # within the minute of the last line: quiet
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["prefill: 0/2 rows, 60% of the steps, about 47 s left"]


def test_a_long_run_with_data_on_the_simulator_is_announced(
    tiny_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(prefill_command, "numpy_seconds", lambda model, runs: 600.0)
    argv = ("prefill", str(tiny_path), "--backend", "sim", "-p", "16", "-ub", "16", "--slots", "0")
    code, _, err = _run(capsys, *argv, "-r", "1")
    assert code == 0
    (said,) = [line for line in err.splitlines() if "will take about" in line]
    assert "about 10 min" in said and "estimate" in said and "--timing-only" in said

    def never(model: MoeModel, runs: list[Settings]) -> float:
        raise AssertionError("a timing-only run computes nothing with numpy")

    monkeypatch.setattr(prefill_command, "numpy_seconds", never)
    code, _, err = _run(capsys, *argv, "--timing-only")
    assert code == 0 and "will take about" not in err


def test_the_estimate_counts_every_pass_over_the_experts(tiny_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings(Batching(32, 16, 0), (0, 3), (HostMemoryMode.PINNED,), repeats=1)
    with MoeModel.open(tiny_path) as model:
        assert numpy_seconds(model, [settings]) == 0.0  # a tiny model: surely short, nothing timed
        monkeypatch.setattr("expertstream.cli.estimate.SAMPLE_FROM_BYTES", 0)
        # (warm-up + 2 ubatches) x (2 rows + compute only) passes over 2 layers x 3 tensors x 8 experts
        seconds = numpy_seconds(model, [settings], sample=lambda m, t: ExpertCost(1.0, float("inf")))
    assert seconds == 3 * 3 * 2 * 3 * 8


def test_the_estimate_counts_a_short_last_ubatch_at_its_own_size(
    tiny_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("expertstream.cli.estimate.SAMPLE_FROM_BYTES", 0)
    settings = Settings(Batching(17, 16, 0), (0,), (HostMemoryMode.PINNED,), repeats=1, warmup=False)
    with MoeModel.open(tiny_path) as model:
        seconds = numpy_seconds(model, [settings], sample=lambda m, t: ExpertCost(1.0, float("inf")))
    # (16 tokens: all 8 experts; 1 token: its top-2) x (1 row + compute only) x 2 layers x 3 tensors
    assert seconds == (8 + 2) * 2 * 2 * 3


def test_ncmoe_beyond_the_layers_is_said_once_and_every_row_shows_its_setting(
    tiny_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "-m", str(tiny_path), "-p", "16", "-ub", "16", "--slots", "0", "-r", "1", "-ncmoe", "all,24,1"]
    code, out, err = _run(capsys, *argv, "-o", "json")
    assert code == 0
    assert [r["n_cpu_moe"] for r in json.loads(out)["rows"]] == ["all", 24, 1]
    assert err.count("-ncmoe 24 is more than the model's 2 MoE layers") == 1
    code, out, _ = _run(capsys, *argv)
    lines = out.splitlines()
    header = next(line for line in lines if line.lstrip().startswith("slots"))
    end = header.index(" ncmoe") + len(" ncmoe")  # cells are right-aligned under their names
    assert [line[:end].split()[-1] for line in lines if line.split()[:1] == ["0"]] == ["all", "24", "1"]
    code, out, _ = _run(capsys, *argv, "-o", "csv")
    assert [row["n_cpu_moe"] for row in csv.DictReader(io.StringIO(out))] == ["all", "24", "1"]
    code, out, _ = _run(capsys, "bench", "-m", str(tiny_path), "-p", "16", "-ub", "16", "--slots", "0", "-o", "json")
    assert "n_cpu_moe" not in json.loads(out)["rows"][0]


def test_gpu_memory_shows_in_every_row(tiny_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "-m", str(tiny_path), "-p", "16", "-ub", "16", "--slots", "0", "-r", "1", "--gpu-memory", "1G"]
    code, out, _ = _run(capsys, *argv, "-o", "json")
    assert code == 0 and json.loads(out)["rows"][0]["gpu_memory"] == "1G"
    code, out, _ = _run(capsys, *argv, "-o", "md")
    assert "| gpu mem |" in out and "| 1G |" in out
