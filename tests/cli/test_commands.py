"""The prefill and demo commands: table, JSON, trace, and a non-zero exit when rows disagree."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from expertstream.backends import ENV_VAR
from expertstream.backends.base import Backend
from expertstream.bench.report import Row
from expertstream.cli import main
from expertstream.cli.prefill import DEMO_PROMPT
from expertstream.engine.runner import MoeRunner

SMALL = ["--tokens", "32", "--ubatch", "16", "-r", "1"]
ROW_KEYS = {
    "slots": int,
    "host_memory": str,
    "ttft_s": float,
    "prefill_tokens_per_s": float,
    "h2d_gbps": float,
    "h2d_pct_of_peak": float,
    "overlap_efficiency": float,
    "over_compute_ms": float,
    "ttft_sd_s": float,
    "prefill_tokens_per_s_sd": float,
    "layers_streamed": int,
    "bytes_per_ubatch": int,
    "output_sha256": str,
    "decode_tokens_per_s": float,
    "fires": int,
}


def _prefill(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["prefill", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_rows_per_slot_setting(backend: Backend, tiny_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _prefill(
        capsys,
        str(tiny_path),
        "--backend",
        backend.name,
        *SMALL,
        "--slots",
        "0,3",
        "--host-memory",
        "pinned,mmap",
        "--decode",
        "3",
        "--json",
    )
    assert code == 0
    doc = json.loads(out)
    assert doc["backend"] == backend.name and doc["model"]["n_expert"] == 8 and doc["device"]
    assert [(r["host_memory"], r["slots"]) for r in doc["rows"]] == [
        ("pinned", 0),
        ("pinned", 3),
        ("mmap", 0),
        ("mmap", 3),
    ]
    for row in doc["rows"]:
        for key, kind in ROW_KEYS.items():
            assert isinstance(row[key], kind), key
        assert row["ttft_s"] > 0 and row["h2d_pct_of_peak"] > 0 and row["overlap_efficiency"] > 0
        assert len(row["output_sha256"]) == 64 and row["decode_steps"] == 3
        assert (row["fires"] > 0) == (row["slots"] > 0)
    assert len({r["output_sha256"] for r in doc["rows"]}) == 1
    assert doc["compute_only_sha256"] == doc["rows"][0]["prefill_sha256"]


def test_exit_status_names_rows_whose_outputs_differ(
    backend: Backend, tiny_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real_output = MoeRunner.prefill_output
    calls = {"n": 0}

    def corrupt_third(self: MoeRunner) -> np.ndarray:
        calls["n"] += 1  # 1: compute-only baseline, 2: slots 0, 3: slots 2
        out = real_output(self).copy()
        if calls["n"] == 3:
            out[0, 0] += 1.0
        return out

    monkeypatch.setattr(MoeRunner, "prefill_output", corrupt_third)
    code, _, err = _prefill(
        capsys, str(tiny_path), "--backend", backend.name, *SMALL, "--slots", "0,2", "--host-memory", "pinned"
    )
    assert code == 1
    assert "outputs differ between rows: slots=0/pinned, slots=2/pinned" in err


def test_trace_is_a_chrome_trace_of_copies_and_kernels(
    backend_name: str, tiny_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.json"
    code, out, _ = _prefill(
        capsys, str(tiny_path), "--backend", backend_name, *SMALL, "--slots", "3", "--trace", str(trace)
    )
    assert code == 0 and "slots" in out
    events = json.loads(trace.read_text())["traceEvents"]
    kinds = {e.get("cat") for e in events}
    assert {"h2d", "kernel"} <= kinds
    # Q4_0 experts, on any mul_mat_id kernel family, at any tile height
    pattern = r"moe_(mul_mat_id|gate_up)_(mma_|int8_|direct_)?q4_0_m\d+"
    assert any(re.fullmatch(pattern, e.get("name", "")) for e in events)


def test_timing_only_full_scale_overlaps_copies(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _prefill(
        capsys,
        "--backend",
        "sim",
        "--timing-only",
        "--preset",
        "qwen3-30b-a3b",
        "--layers",
        "2",
        "--tokens",
        "4096",
        "--ubatch",
        "2048",
        "--slots",
        "0,3",
        "--json",
    )
    assert code == 0
    doc = json.loads(out)
    assert doc["timing_only"] and doc["model"]["n_expert"] == 128
    off, on = doc["rows"]
    assert off["output_sha256"] == on["output_sha256"] == ""
    assert on["fires"] == 2 * 2 * 3
    assert on["ttft_s"] < off["ttft_s"], "copies overlap compute with slots"


def test_sim_options_refuse_another_backend_and_choose_the_simulator_otherwise(
    tiny_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)  # auto, whatever backend the suite runs on
    code, _, err = _prefill(capsys, str(tiny_path), "--backend", "cuda", "--timing-only")
    assert code == 2 and "--timing-only is simulator-only, not for cuda" in err
    code, out, _ = _prefill(capsys, str(tiny_path), *SMALL, "--slots", "0", "--timing-only")
    assert code == 0 and "backend sim" in out and "timing only" in out


def test_bad_slot_list_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["prefill", "--slots", "0,1"])
    assert "slots=1 cannot overlap" in capsys.readouterr().err


def test_demo_prints_speed_at_scale_and_equal_bytes(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EXPERTSTREAM_BACKEND", "sim")  # the default backend of a machine without GPU
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    speed, _, data = out.partition("Bytes:")
    assert "timing only" in speed and "128 experts" in speed
    speed_rows = [line.split() for line in speed.splitlines() if line.split()[:1] in (["0"], ["3"])]
    assert [row[0] for row in speed_rows] == ["0", "3"]
    ttft = {row[0]: float(row[2]) for row in speed_rows}
    assert ttft["3"] < ttft["0"], "the lookahead must shorten prefill at real expert sizes"
    data_rows = [line.split() for line in data.splitlines() if line.split()[:1] in (["0"], ["2"], ["3"])]
    assert [row[0] for row in data_rows] == ["0", "2", "3"]
    assert len({row[-1] for row in data_rows}) == 1
    # before the rows: a prompt becoming text through the whole model, greedy, so the same text each run
    text, _, _ = out.partition("Speed:")
    assert "Text: a prompt through a tiny made model" in text
    continued = [line for line in text.splitlines() if line.startswith(f"{DEMO_PROMPT}|")]
    assert len(continued) == 1 and len(continued[0]) > len(DEMO_PROMPT) + 1, text


@pytest.mark.parametrize(("asked", "taken"), [("auto", "mma"), ("simt", "simt"), ("int8", "int8"), ("mma", "mma")])
def test_matrix_path_is_chosen_and_reported(
    tiny_path: Path, capsys: pytest.CaptureFixture[str], asked: str, taken: str
) -> None:
    code, out, _ = _prefill(
        capsys, str(tiny_path), "--backend", "sim", "--sim-profile", "cuda-h200", *SMALL, "--slots", "0",
        "--matrix-path", asked, "--json",
    )  # fmt: skip
    assert code == 0
    assert json.loads(out)["matrix_paths"] == {"Q4_0": taken}


def test_direct_kernels_and_the_fused_gate_up_are_reported_and_give_the_same_bytes(
    tiny_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    docs = {}
    for flags in ((), ("--fuse-gate-up",), ("--no-direct",)):
        code, out, _ = _prefill(
            capsys, str(tiny_path), "--backend", "sim", "--sim-profile", "cuda-h200", *SMALL, "--slots", "0,3",
            *flags, "--json",
        )  # fmt: skip
        assert code == 0
        docs[flags] = json.loads(out)
    assert docs[()]["kernel_families"] == {"Q4_0": "direct"} and not docs[()]["gate_up_fused"]
    assert docs[("--fuse-gate-up",)]["gate_up_fused"]
    assert docs[("--no-direct",)]["kernel_families"] == {"Q4_0": "mma"}
    assert all(d["matrix_paths"] == {"Q4_0": "mma"} for d in docs.values())
    hashes = {flags: {r["output_sha256"] for r in d["rows"]} for flags, d in docs.items()}
    assert hashes[()] == hashes[("--fuse-gate-up",)] and len(hashes[()]) == 1


def test_a_matrix_path_the_device_lacks_is_refused(tiny_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _prefill(
        capsys, str(tiny_path), "--backend", "sim", "--sim-profile", "rocm-r9700", *SMALL, "--matrix-path", "int8"
    )
    assert code == 2
    assert "no int8 matrix instructions" in err and "use auto" in err


def test_the_ring_geometry_is_taken_and_its_time_reported(
    tiny_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from expertstream.hostmem import StagingRing

    made: list[tuple[int, int, int]] = []
    real = StagingRing.__init__

    def recording(self: StagingRing, *args: object, **kwargs: int) -> None:
        made.append((kwargs["chunks"], kwargs["threads"], kwargs["part_bytes"]))
        real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(StagingRing, "__init__", recording)
    geometry = ["--ring-chunks", "3", "--ring-chunk-mib", "1", "--ring-part-mib", "2", "--ring-threads", "2"]
    code, out, _ = _prefill(
        capsys,
        str(tiny_path),
        "--backend",
        "sim",
        *SMALL,
        "--slots",
        "0,2",
        "--host-memory",
        "ring,pinned",
        *geometry,
        "--json",
    )
    assert code == 0 and made == [(3, 2, 2 << 20)]
    rows = json.loads(out)["rows"]
    ring, pinned = [r for r in rows if r["host_memory"] == "ring"], [r for r in rows if r["host_memory"] == "pinned"]
    assert len(ring) == len(pinned) == 2
    for row in ring:
        assert row["ring_threads"] == 2 and 0 < row["ring_copy_pct"] <= 100 and row["ring_thread_gbps"] > 0
    assert all(r["ring_copy_pct"] is None for r in pinned)
    code, out, _ = _prefill(capsys, str(tiny_path), "--backend", "sim", *SMALL, "--host-memory", "ring", *geometry)
    assert code == 0 and out.splitlines()[-1].startswith("staging ring (2 fill processes): copying ")
    code, _, err = _prefill(
        capsys, str(tiny_path), "--backend", "sim", *SMALL, "--host-memory", "ring", "--ring-chunks", "1"
    )
    assert code == 2 and "chunks >= 2" in err


@pytest.mark.parametrize(
    ("shares", "says"),
    [
        (
            [(78, 19), (73, 12)],
            "copying 73-78% of the time, waiting for chunk DMAs 12-19%, 4.0 GB/s per thread "
            "while copying: the host's copy from the mapping bounds it; more slots will not help; its rows "
            "reached 1% of the pinned peak, what this host's copies allow",
        ),
        ([(12, 88), (23, 77)], "the copies to the device hold it back"),
        ([(2, 0), (3, 1)], "mostly idle"),
        ([(45, 30), (41, 56)], "waiting for chunk DMAs 30-56%, 4.0 GB/s per thread while copying"),
    ],
)
def test_the_ring_note_says_what_bounds_the_ring(
    shares: list[tuple[float, float]], says: str, make_row: Callable[..., Row]
) -> None:
    from expertstream.bench.report import ring_note

    def ring_row(copy: float | None, wait: float | None) -> Row:
        ring = copy is not None
        return make_row(
            host_memory="ring" if ring else "registered",
            ring_threads=12 if ring else None,
            ring_copy_pct=copy,
            ring_chunk_wait_pct=wait,
            ring_thread_gbps=4.0 if ring else None,
        )

    rows = [ring_row(copy, wait) for copy, wait in shares] + [ring_row(None, None)]
    note = ring_note(rows)
    assert note is not None and note.startswith("staging ring (12 threads): ") and says in note
    if shares[0] == (45, 30):
        assert note.endswith("while copying; its rows reached 1% of the pinned peak")  # no verdict
    assert ring_note([ring_row(None, None)]) is None


def test_rows_of_mode_disk_have_a_note_of_their_own(make_row: Callable[..., Row]) -> None:
    from expertstream.bench.report import disk_note, ring_note

    disk = make_row(host_memory="disk", ring_threads=12, ring_copy_pct=95.0, ring_chunk_wait_pct=1.0, h2d_gbps=6.3)
    note = disk_note([disk, make_row(host_memory="registered")])
    assert note is not None and note.startswith("reads from the drive (12 threads): ") and "the drive bounds it" in note
    assert ring_note([disk]) is None  # the mapping's copies bound no row of mode disk
    assert disk_note([make_row(host_memory="ring", ring_threads=12, ring_copy_pct=95.0)]) is None


def test_the_trace_marks_where_decode_begins_with_nothing_of_prefill_in_flight(
    backend_name: str, tiny_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.json"
    code, _, _ = _prefill(
        capsys,
        str(tiny_path),
        "--backend",
        backend_name,
        *SMALL,
        "-n",
        "3",
        "--slots",
        "3",
        "--host-memory",
        "pinned",
        "--trace",
        str(trace),
    )
    assert code == 0
    events = json.loads(trace.read_text())["traceEvents"]
    marks = [e for e in events if e.get("cat") == "mark"]
    assert [m["name"] for m in marks] == ["slots 3, pinned: prefill ends, decode begins"]
    switch = marks[0]["ts"]
    spans = [e for e in events if e.get("ph") == "X" and e["pid"] != 0]  # device operations
    before = [e for e in spans if e["ts"] < switch]
    after = [e for e in spans if e["ts"] >= switch]
    assert before and after, "operations on both sides of the switch"
    # The prefill's copies and kernels (its lookahead's included) have all ended when decode begins.
    assert max(e["ts"] + e["dur"] for e in before) <= switch


def test_decode_copies_follow_the_tuned_profile_unless_asked(
    tiny_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = tmp_path / "dma.json"  # as tune writes it where the DMAs' steps were the faster
    profile.write_text(json.dumps({"base": "cuda-h200", "name": "dma-faster", "decode_gather": False}))
    docs = {}
    for flags in ((), ("--predict", str(profile)), ("--predict", str(profile), "--decode-copies", "gather"),
                  ("--decode-copies", "dma"), ("--no-gather",)):  # fmt: skip
        code, out, err = _prefill(capsys, str(tiny_path), "--backend", "sim", *SMALL, "--decode", "3", *flags, "--json")
        assert code == 0, err
        docs[flags] = json.loads(out)
    copies = [d["decode_copies"] for d in docs.values()]
    assert copies == ["gather", "dma", "gather", "dma", "dma"]
    assert len({r["output_sha256"] for d in docs.values() for r in d["rows"]}) == 1  # the same bytes either way
    both = ("--no-gather", "--decode-copies", "gather")
    code, _, err = _prefill(capsys, str(tiny_path), "--backend", "sim", *SMALL, *both)
    assert code == 2 and "--no-gather asks for --decode-copies dma" in err
