"""What a user of the command line relies on: exit statuses, one-line errors, outputs checked first."""

from __future__ import annotations

import io
import json
import struct
import sys
import tempfile
from pathlib import Path

import pytest

import expertstream.cli.prefill as moe_commands
from expertstream.cli import main
from expertstream.engine.runner import MoeRunner

from . import run_main as _run

SMALL = ["--tokens", "32", "--ubatch", "16", "-r", "1"]


def _never_measure(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("the run started before its arguments were checked")

    monkeypatch.setattr(moe_commands, "measure", fail)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--slots", ","], "expected slot counts"),
        (["--host-memory", ","], "expected host memory modes"),
        (["--preset", "tiny", "MODEL"], "--preset describe a model to make"),
        (["--type", "q8_0", "--layers", "1", "MODEL"], "--type, --layers describe a model to make"),
        (["-ub", "16", "-b", "24"], "not a multiple of -ub 16"),
        (["--host-memory", "pinned", "--no-mmap"], "choose host memory once"),
        (["--decode-lookahead", "2.5"], "'2.5' is not a count of experts"),
        (["--decode-lookahead", "-1"], "must be >= 0, got -1"),
    ],
)
def test_usage_errors_exit_2_before_running(
    argv: list[str],
    message: str,
    tiny_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _never_measure(monkeypatch)
    argv = [str(tiny_path) if a == "MODEL" else a for a in argv]
    code, _, err = _run(capsys, "prefill", *argv)
    assert code == 2 and message in err


def test_timing_only_refuses_a_gpu_named_by_the_environment(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EXPERTSTREAM_BACKEND", "cuda")
    _never_measure(monkeypatch)
    code, _, err = _run(capsys, "prefill", "--timing-only", *SMALL)
    assert code == 2 and "simulator-only" in err and "EXPERTSTREAM_BACKEND=cuda" in err


def test_trace_in_a_missing_folder_is_refused_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _never_measure(monkeypatch)
    code, _, err = _run(capsys, "prefill", *SMALL, "--trace", str(tmp_path / "missing" / "t.json"))
    assert code == 2 and "does not exist" in err


def test_ctrl_c_between_ubatches_stops_with_130_and_removes_scratch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    calls = {"n": 0}
    route = MoeRunner._route

    def interrupted(self: MoeRunner, *args: object) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        route(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(MoeRunner, "_route", interrupted)
    trace = tmp_path / "trace.json"
    code, out, err = _run(capsys, "prefill", "--backend", "sim", *SMALL, "--trace", str(trace))
    assert code == 130 and "interrupted" in err and out == ""
    assert not trace.exists() and not list(tmp_path.glob("expertstream-*"))


def test_truncated_model_is_one_line_with_sizes(
    tiny_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tiny_path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:-1000])
    code, _, err = _run(capsys, "prefill", str(cut), *SMALL)
    assert code == 2
    assert err.strip() == (
        f"expertstream: error: {cut}: truncated: its header describes {len(data)} bytes of file, "
        f"the file has {len(data) - 1000}"
    )


def test_huge_tensor_count_is_a_corrupt_header(
    tiny_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = bytearray(tiny_path.read_bytes())
    data[8:16] = struct.pack("<Q", 10**12)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    code, _, err = _run(capsys, "prefill", str(bad), *SMALL)
    assert code == 2 and "corrupt GGUF header: it declares 1000000000000 tensors" in err
    assert len(err.strip().splitlines()) == 1


def test_llama_bench_spelling_expands_a_matrix_with_spread_and_provenance(
    tiny_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _run(
        capsys, "bench", "-m", str(tiny_path), "-p", "32", "-n", "2", "-ub", "8,16", "-b", "16",
        "--slots", "0,3", "-lm", "none", "-ncmoe", "all", "-r", "2", "-o", "json", "--backend", "sim",
    )  # fmt: skip
    assert code == 0
    doc = json.loads(out)
    assert [(r["ubatch"], r["slots"]) for r in doc["rows"]] == [(8, 0), (8, 3), (16, 0), (16, 3)]
    for row in doc["rows"]:
        assert row["repetitions"] == 2 and row["host_memory"] == "pinned" and row["batch"] == 16
        assert row["ttft_sd_s"] >= 0 and row["layers_streamed"] == 2 and row["bytes_per_ubatch"] > 0
        assert row["transfer_floor_tokens_per_s"] > 0 and row["compute_only_tokens_per_s"] > 0
        assert row["decode_tokens_per_s"] > 0 and row["decode_tokens_per_s_sd"] is not None
    assert doc["version"] and doc["seed"] == 0 and "-ub 8,16" in doc["command_line"]
    assert "numpy" in doc["libraries"] and "driver_version" in doc


def test_ncmoe_streams_only_the_first_layers_with_the_same_outputs(
    tiny_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _run(
        capsys, "bench", "-m", str(tiny_path), "-ncmoe", "all,1,0", "--slots", "0,3", *SMALL, "-o", "json"
    )
    assert code == 0
    rows = json.loads(out)["rows"]
    assert [(r["layers_streamed"], r["layers_resident"]) for r in rows] == [(2, 0)] * 2 + [(1, 1)] * 2 + [(0, 2)] * 2
    assert len({r["output_sha256"] for r in rows}) == 1
    assert rows[2]["streamed_bytes_per_ubatch"] * 2 == rows[0]["streamed_bytes_per_ubatch"]
    assert rows[4]["h2d_bytes"] == 0


def test_ncmoe_and_gpu_memory_are_not_given_together(tiny_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "bench", "-m", str(tiny_path), "-ncmoe", "1", "--gpu-memory", "1G", *SMALL)
    assert code == 2 and "-ncmoe and --gpu-memory" in err


def test_rows_say_whether_the_whole_model_or_the_expert_blocks_alone_ran(
    tiny_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = {}
    for extra in ([], ["--experts-only"]):
        code, out, _ = _run(capsys, "bench", "-m", str(tiny_path), "--slots", "0", *SMALL, *extra, "-o", "json")
        assert code == 0
        (row,) = json.loads(out)["rows"]
        runs[row["work"]] = row
    assert set(runs) == {"whole", "experts"}
    # The same expert bytes cross either way; the whole model's output is the head's, not the blocks'.
    assert runs["whole"]["h2d_bytes"] == runs["experts"]["h2d_bytes"]
    assert runs["whole"]["output_sha256"] != runs["experts"]["output_sha256"]
    code, _, err = _run(capsys, "bench", "-m", str(tiny_path), *SMALL, "--experts-only", "--prefill-order", "layer")
    assert code == 2 and "layer-major prefill runs the whole model" in err


@pytest.mark.parametrize("fmt", ["csv", "md", "jsonl"])
def test_output_formats(fmt: str, tiny_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "prefill", str(tiny_path), *SMALL, "--slots", "0,3", "-o", fmt, "--backend", "sim")
    assert code == 0
    lines = out.strip().splitlines()
    if fmt == "csv":
        assert lines[0].startswith("slots,host_memory,") and len(lines) == 3
    elif fmt == "md":
        assert lines[0].startswith("| slots |") and len(lines) == 4
    else:
        assert [json.loads(line)["slots"] for line in lines] == [0, 3]


def test_type_names_are_case_insensitive(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "m.gguf"
    code, text, _ = _run(capsys, "make-model", "--preset", "TINY", "--type", "q4_0", "--layers", "1", "-o", str(out))
    assert code == 0 and "Q4_0" in text


def test_help_states_defaults_columns_and_exit_statuses(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "prefill", "--help")
    assert code == 0
    text = " ".join(out.split())
    assert "(default: 0,2,3,4)" in text and "(default: 512)" in text
    assert "overlap max(transfer only, compute only) / ttft" in text
    assert "slot wait ms" in text and "+compute ms" in text
    assert "0 ok; 1 outputs differ" in text and "130 interrupted" in text


def test_demo_json_is_one_document(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXPERTSTREAM_BACKEND", "sim")
    code, out, _ = _run(capsys, "demo", "--json")
    assert code == 0
    runs = json.loads(out)["runs"]
    assert [r["timing_only"] for r in runs] == [True, False]


def test_info_says_what_auto_picks_and_honours_the_environment(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EXPERTSTREAM_BACKEND", "sim")
    code, out, _ = _run(capsys, "info", "--json")
    assert code == 0 and json.loads(out)["auto"] == "sim"
    code, out, _ = _run(capsys, "info")
    assert out.startswith("auto: sim (from EXPERTSTREAM_BACKEND)")


def test_unusable_backend_hint_mentions_the_variable_only_when_set(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from expertstream.backends import available_backends

    unusable = [s.name for s in available_backends() if not s.usable]
    if not unusable:
        pytest.skip("every backend is usable here")
    monkeypatch.delenv("EXPERTSTREAM_BACKEND", raising=False)
    code, _, err = _run(capsys, "prefill", "--backend", unusable[0], *SMALL)
    assert code == 2 and "EXPERTSTREAM_BACKEND" not in err
    monkeypatch.setenv("EXPERTSTREAM_BACKEND", unusable[0])
    code, _, err = _run(capsys, "prefill", *SMALL)
    assert code == 2 and "unset it" in err


def test_closed_stdout_is_quiet(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    class ClosedPipe(io.StringIO):
        def write(self, text: str) -> int:
            raise BrokenPipeError

    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert main(["info"]) == 141
    assert "Traceback" not in capsys.readouterr().err
