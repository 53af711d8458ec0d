"""microbench/decode_profile.py on the simulator: one step's operations, the same as a step issues."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from microbench import decode_profile


def test_the_profile_counts_a_steps_operations_and_a_ubatchs(
    tiny_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "profile.json"
    code = decode_profile.main(
        ["--backend", "sim", "--model", str(tiny_path), "-p", "16", "-n", "4", "--out", str(out), "--json"]
    )
    assert code == 0
    result = json.loads(out.read_text())
    assert result["path"] == "graph" and len(result["step_ms_all"]) == 3
    names = {row["name"]: row["calls"] for row in result["rows"]}
    with_layers = {name: calls for name, calls in names.items() if calls % 2 == 0}
    # Two MoE layers: each a router (logits and selection in one launch), q/k/v prepared in one launch,
    # attention and its combine in a launch each (the joined launch is off by default).
    for name in ("moe_router_logits_select", "dense_qkv_rope_store", "attn_decode_d64", "attn_decode_combine"):
        assert with_layers.get(name) == 2, (name, names)
    assert sum(names.values()) == result["calls"]
    assert sum(row["share"] for row in result["rows"]) == pytest.approx(1.0)
    assert result["prefill_calls"] > result["calls"] and result["step_bytes"] > 0
    assert "one decode step" in capsys.readouterr().err


def test_alone_times_each_launch_of_a_step_on_its_own(tiny_path: Path, tmp_path: Path) -> None:
    """--alone: every kernel launch of a step timed in a graph of its repeats, summed per name; the
    step's launches are those the traced step counts, and Stream.launch is itself again after."""
    launch = decode_profile.Stream.launch
    out = tmp_path / "profile.json"
    code = decode_profile.main(
        ["--backend", "sim", "--model", str(tiny_path), "-p", "16", "-n", "4", "--alone", "--out", str(out)]
    )
    assert code == 0
    assert decode_profile.Stream.launch is launch
    result = json.loads(out.read_text())
    kernels = [row for row in result["rows"] if row["name"] != "graph" and not row["name"].startswith("copy")]
    assert result["alone_launches"] == sum(row["calls"] for row in kernels)
    assert all(row["alone_us"] > 0 for row in kernels)
    assert result["alone_ms"] == pytest.approx(sum(row["alone_us"] for row in kernels) / 1e3)
