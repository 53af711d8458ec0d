"""microbench/gather_rates.py: the shapes it compiles, and its rows on the simulator (bytes checked)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from expertstream.backends._gpu import gather_source
from microbench import gather_rates


def test_a_shape_sets_the_loads_in_flight_and_the_bytes_a_block_copies() -> None:
    source = gather_rates.variant_source(16, 131072)
    assert "#define GATHER_IN_FLIGHT 16  //" in source and "#define GATHER_CHUNK_BYTES 131072ull" in source
    # the shipped shape is gather.cu as it stands
    assert gather_rates.variant_source(*gather_rates.SHIPPED[1:]) == gather_source()


def test_a_source_that_lost_a_define_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gather_rates, "gather_source", lambda: "#define GATHER_CHUNK_BYTES 32768ull\n")
    with pytest.raises(ValueError, match="GATHER_IN_FLIGHT 0 times"):
        gather_rates.variant_source(8, 65536)


def test_on_the_simulator_the_copy_engines_and_the_backends_gather_move_the_routed_rows(tmp_path: Path) -> None:
    out = tmp_path / "gather.json"
    args = ["--backend", "sim", "--experts", "16", "--used", "4", "--launches", "3", "--rounds", "2"]
    assert gather_rates.main([*args, "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["path"] for r in rows] == ["dma block", "dma rows", "backend"]
    assert [r["bytes_ok"] for r in rows] == [None, True, True]
    assert all(r["gb_per_s"] > 0 for r in rows)
