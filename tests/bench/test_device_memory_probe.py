"""microbench.device_memory on the simulator: its stages add up to expertstream's own count."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from expertstream.model import make_model
from microbench import device_memory


def test_the_stages_show_the_run_and_closing_gives_every_byte_back(tmp_path: Path) -> None:
    model = make_model("tiny", "Q4_0", tmp_path / "tiny.gguf")
    out = tmp_path / "memory.json"
    args = ["--backend", "sim", "--model", str(model), "--prompt", "40", "--steps", "3", "--out", str(out)]
    assert device_memory.main(args) == 0
    result = json.loads(out.read_text())
    used = {row["stage"]: row["used_mib"] for row in result["rows"]}
    context, closed = used["context made (backend open)"], used["model closed"]
    after = used["after 40 + 3 tokens"]
    own = result["expertstream_mib"]
    # The simulator's device holds only what expertstream allocates: after generating, the weights,
    # the KV cache and the activations are still held (the staging went with the decode's release).
    held = own["weights"] + own["kv_cache"] + own["activations"] + own["resident_experts"]
    assert after - context == pytest.approx(held, abs=1e-6)
    assert own["staging"] > 0 and own["total"] == pytest.approx(sum(v for k, v in own.items() if k != "total"))
    assert closed == context


def test_the_stack_limit_is_refused_where_the_backend_has_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXPERTSTREAM_STACK_LIMIT", "")  # the benchmark sets it; this puts it back after
    model = make_model("tiny", "Q4_0", tmp_path / "tiny.gguf", layers=1)
    with pytest.raises(SystemExit, match="--stack-limit is the CUDA backend's"):
        device_memory.main(["--backend", "sim", "--model", str(model), "--stack-limit", "256"])
