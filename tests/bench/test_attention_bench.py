"""microbench/attention.py on the simulator: the rows it times, the kernels they name, the FLOPs they count."""

from __future__ import annotations

import json
from pathlib import Path

from microbench import attention


def test_visible_pairs_count_the_causal_prefix_and_the_window() -> None:
    # Queries at positions 2, 3 of a 4-position context see 3 and 4 keys; a window of 2 caps both at 2.
    assert attention.visible_pairs(2, 4, 0) == 7
    assert attention.visible_pairs(2, 4, 2) == 4
    assert attention.visible_pairs(4, 4, 0) == 10


def test_every_shape_runs_and_names_the_launchers_kernel(tmp_path: Path) -> None:
    out = tmp_path / "attention.json"
    code = attention.main(
        [
            *("--backend", "sim", "--tokens", "32", "--context", "16", "64"),
            *("--repeats", "1", "--warmup", "0", "--out", str(out), "--json"),
        ]
    )
    assert code == 0
    rows = json.loads(out.read_text())["rows"]
    # A context shorter than the ubatch is skipped: one row per shape.
    assert [(r["shape"], r["context"]) for r in rows] == [(name, 64) for name in attention.SHAPES]
    kernels = {r["shape"]: r["kernel"] for r in rows}
    # The simulator's default profile (an H200) has matrix cores, mma.sync fragments and the shared memory.
    assert kernels == {
        "qwen3-30b-a3b": "attn_prefill_mma128_d128",
        "gpt-oss-20b": "attn_prefill_mma_d64",
        "qwen3-next": "attn_wide_mma_d256",
        "deepseek2-latent": "attn_wide_mma_d576",
    }
    assert all(r["kernel_ms"] > 0 and r["tflops"] > 0 for r in rows)
