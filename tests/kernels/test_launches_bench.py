"""microbench.launches on the simulator: one call's launches, each replayed and timed alone."""

from __future__ import annotations

import json

import pytest

from microbench import launches


def test_a_calls_launches_are_each_timed_and_add_up_to_the_call(capsys: pytest.CaptureFixture[str]) -> None:
    assert launches.main(["--profile", "cuda-h200", "--types", "Q4_0", "--ubatch", "512", "--json"]) == 0
    rows = [r for r in json.loads(capsys.readouterr().out)["rows"] if r["tensor"] == "gate/up"]
    assert [r["launch"] for r in rows] == [
        "call",
        "moe_round_x_direct",
        "moe_group_count",
        "moe_group_place",
        "moe_mul_mat_id_direct_q4_0_m64",
    ]
    assert all(r["ms"] > 0 for r in rows)
    # On the simulator the launches run back to back as they do inside the call.
    assert sum(r["ms"] for r in rows[1:]) == pytest.approx(rows[0]["ms"], rel=1e-3)
