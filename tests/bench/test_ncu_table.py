"""microbench/ncu_table.py: a table of an ncu report's raw page, kernels of one name in one row."""

from __future__ import annotations

from pathlib import Path

import pytest

from microbench import ncu_table

STALL = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"


def write_report(path: Path) -> None:
    header = [
        "ID",
        "Kernel Name",
        "gpu__time_duration.sum",
        "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
        "launch__grid_size",
        STALL.format("long_scoreboard"),
        STALL.format("barrier"),
        STALL.format("wait"),
        STALL.format("math_pipe_throttle"),
    ]
    units = ["", "", "usecond", "%", "", "inst", "inst", "inst", "inst"]
    rows = [
        ["0", "gemv(int, float*)", "3.5", "20", "1,024", "4.0", "0.5", "1.0", "0.1"],
        ["1", "gemv(int, float*)", "4.5", "30", "1,024", "2.0", "0.5", "1.0", "0.3"],
        ["2", "norm(float*)", "2.0", "1", "1", "9.0", "3.0", "0.2", "0.0"],
    ]
    lines = ["==PROF== a note ncu prints unquoted"]
    lines += [",".join(f'"{v}"' for v in row) for row in (header, units, *rows)]
    path.write_text("\n".join(lines) + "\n")


def test_kernels_of_one_name_share_a_row_in_order_of_their_time(tmp_path: Path) -> None:
    report = tmp_path / "r.csv"
    write_report(report)
    gemv, norm = ncu_table.kernel_rows(ncu_table.read(str(report)))
    # gemv's two launches (8 us) before norm's one (2 us); thousands separators read as numbers
    assert (gemv["kernel"], gemv["n"], gemv["sum_us"], gemv["us"]) == ("gemv", 2, 8.0, 4.0)
    assert gemv["dram_pct"] == 25.0 and gemv["grid"] == 1024
    assert (norm["kernel"], norm["n"], norm["sum_us"], norm["us"]) == ("norm", 1, 2.0, 2.0)
    assert norm["registers"] is None  # not in the report: shown as "-"
    # the three costliest stall reasons, largest first, as means over the launches
    assert gemv["stalls"] == "long_scoreboard 3.0 wait 1.0 barrier 0.5"
    assert norm["stalls"] == "long_scoreboard 9.0 barrier 3.0 wait 0.2"
    assert ncu_table.summary([gemv, norm]) == "3 kernels, 10.0 us of kernel time"


def test_a_report_with_no_kernels_is_named(tmp_path: Path) -> None:
    report = tmp_path / "empty.csv"
    report.write_text('"ID","Kernel Name"\n')
    with pytest.raises(SystemExit, match="no kernels"):
        ncu_table.read(str(report))


def test_times_in_nanoseconds_are_read_as_microseconds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "ns.csv"
    report.write_text('"ID","Kernel Name","gpu__time_duration.sum"\n"","","nsecond"\n"0","k()","2,500"\n')
    assert ncu_table.main([str(report), "--summary"]) == 0
    assert capsys.readouterr().out == "1 kernels, 2.5 us of kernel time\n"
