"""A row's derived figures (% of peak, transfer floor, overlap, time over compute) against hand-computed values.

The timed runs are scripted: every prefill with streamed experts takes 0.5 s then 1.5 s (median 1.0 s),
the compute-only prefill 0.25 s; the H2D peak is given. The bytes are the tiny model's: 2 layers x
3 expert tensors of 221184 bytes, each copied once per ubatch, 2 ubatches.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

import expertstream
from expertstream.bench import measure as measure_module
from expertstream.bench import report
from expertstream.bench.measure import PeakProbe, Settings, measure
from expertstream.engine.runner import Batching
from expertstream.hostmem import HostMemoryMode
from expertstream.model import MoeModel, make_model
from expertstream.scheduler import RunStats

TOKENS = 32
STREAMED_S = (0.5, 1.5)
COMPUTE_ONLY_S = 0.25
MOVED = 2 * 3 * 221184 * 2  # 2654208 bytes


@pytest.fixture
def scripted_times(monkeypatch: pytest.MonkeyPatch) -> None:
    real = measure_module._timed_runs

    def timed_runs(*args: Any, **kwargs: Any) -> tuple[list[float], RunStats]:
        times, stats = real(*args, **kwargs)
        streamed = stats.bytes_moved() > 0
        return [*STREAMED_S] if streamed else [COMPUTE_ONLY_S] * len(times), stats

    monkeypatch.setattr(measure_module, "_timed_runs", timed_runs)


# peak GB/s -> % of peak, transfer only s, overlap, transfer floor tokens/s, by hand:
#   H2D GB/s = 2654208 B / 1.0 s = 0.002654208; transfer only = 2654208 B / peak
#   overlap = max(transfer only, 0.25 s) / 1.0 s; floor = 32 tokens / transfer only
CASES = {
    10.0: (0.02654208, 0.0002654208, 0.25, 120563.2716049),
    0.001: (265.4208, 2.654208, 2.654208, 12.05632716049),
}


@pytest.mark.usefixtures("scripted_times")
@pytest.mark.parametrize("peak_gbps", list(CASES), ids=["compute-bound", "transfer-bound"])
def test_row_figures_are_the_hand_computed_ones(tiny_path: Path, peak_gbps: float) -> None:
    pct, transfer_s, overlap, floor = CASES[peak_gbps]
    settings = Settings(Batching(TOKENS, 16), (0, 3), (HostMemoryMode.PINNED,), repeats=len(STREAMED_S))
    with expertstream.backend("sim", data=False) as sim, MoeModel.open(tiny_path) as model:
        result = measure(sim, sim.device(0), model, settings, h2d_peak=PeakProbe(peak_gbps, peak_gbps, peak_gbps, 1))
    assert result.baselines.compute_only_s == COMPUTE_ONLY_S
    for row in result.rows:
        assert (row.h2d_bytes, row.bytes_per_ubatch, row.ttft_s) == (MOVED, MOVED // 2, 1.0)
        assert row.h2d_gbps == pytest.approx(0.002654208, rel=1e-9)
        assert row.h2d_peak_gbps == peak_gbps
        assert row.h2d_pct_of_peak == pytest.approx(pct, rel=1e-9)
        assert row.transfer_only_s == pytest.approx(transfer_s, rel=1e-9)
        assert row.transfer_floor_tokens_per_s == pytest.approx(floor, rel=1e-9)
        assert row.compute_only_s == COMPUTE_ONLY_S
        assert row.compute_only_tokens_per_s == pytest.approx(128.0, rel=1e-9)
        assert row.overlap_efficiency == pytest.approx(overlap, rel=1e-9)
        assert row.over_compute_ms == pytest.approx(750.0, rel=1e-9)


def test_rates_without_a_time_to_divide_by_are_none(tiny_path: Path) -> None:
    settings = Settings(Batching(TOKENS, 16), (0,), (HostMemoryMode.PINNED,))
    with expertstream.backend("sim", data=False) as sim, MoeModel.open(tiny_path) as model:
        (row,) = measure(sim, sim.device(0), model, settings, h2d_peak=PeakProbe(10.0, 10.0, 10.0, 1)).rows
    assert dataclasses.replace(row, transfer_only_s=0.0).transfer_floor_tokens_per_s is None  # nothing copied
    assert dataclasses.replace(row, compute_only_s=None).compute_only_tokens_per_s is None  # not measured


def test_device_memory_by_kind_adds_up_to_what_the_device_gave(tiny_path: Path) -> None:
    """The whole model's row: weights, KV cache, activations, resident experts and staging add up to
    what the simulated device's free memory fell by (it counts every allocation, nothing else)."""
    settings = Settings(Batching(TOKENS, 16, 2), (3,), (HostMemoryMode.PINNED,), repeats=1, whole=True, n_cpu_moe=1)
    with expertstream.backend("sim", data=False) as sim, MoeModel.open(tiny_path) as model:
        (row,) = measure(sim, sim.device(0), model, settings, h2d_peak=PeakProbe(10.0, 10.0, 10.0, 1)).rows
    memory = row.device_memory
    assert set(memory) == {"weights", "kv_cache", "activations", "resident_experts", "staging", "total"}
    assert all(memory[kind] > 0 for kind in memory)  # one layer resident, one streamed
    assert memory["kv_cache"] == row.kv_cache_bytes
    assert memory["total"] == sum(v for k, v in memory.items() if k != "total")
    assert row.device_used_bytes == memory["total"]


def test_a_short_prompts_decode_steps_replay_one_graph(tmp_path: Path) -> None:
    """The captured step reads the whole context's cache (more attention chunks than the warm-up step
    at the prompt's end): what it needs is allocated before the capture, which may not allocate."""
    path = make_model("qwen3-30b-a3b", "Q4_0", tmp_path / "q1.gguf", layers=1)
    settings = Settings(Batching(16, 16, 64), (3,), (HostMemoryMode.PINNED,), repeats=1, whole=True, n_cpu_moe=0)
    with expertstream.backend("sim", data=False) as sim, MoeModel.open(path) as model:
        (row,) = measure(sim, sim.device(0), model, settings, h2d_peak=PeakProbe(10.0, 10.0, 10.0, 1)).rows
    assert row.decode_path == "graph"


def test_decode_link_limit_and_share_are_the_hand_computed_ones(tiny_path: Path) -> None:
    settings = Settings(Batching(TOKENS, 16), (0,), (HostMemoryMode.PINNED,))
    with expertstream.backend("sim", data=False) as sim, MoeModel.open(tiny_path) as model:
        (row,) = measure(sim, sim.device(0), model, settings, h2d_peak=PeakProbe(10.0, 10.0, 10.0, 1)).rows
    # 64 steps copying 70.4 GB in all at 55 GB/s: 1.1 GB, 20 ms of copies a step, 50 tokens/s at most.
    row = dataclasses.replace(row, decode_steps=64, decode_bytes=70_400_000_000, h2d_peak_gbps=55.0)
    row = dataclasses.replace(row, decode_tokens_per_s=35.0)
    assert row.decode_link_limit_tokens_per_s == pytest.approx(50.0, rel=1e-12)
    assert row.decode_link_pct == pytest.approx(70.0, rel=1e-12)
    assert report.row_json(row)["decode_link_pct"] == row.decode_link_pct
    assert dataclasses.replace(row, decode_bytes=0).decode_link_limit_tokens_per_s is None  # nothing copied
    assert dataclasses.replace(row, devices=2).decode_link_limit_tokens_per_s is None  # one link's peak
    assert dataclasses.replace(row, decode_tokens_per_s=None).decode_link_pct is None


def test_decode_tokens_per_s_is_the_mean_of_the_repetitions_as_llama_bench_reports(
    tiny_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = measure_module._decode
    rates = [10.0, 20.0, 60.0]  # median 20, mean 30, sample sd 26.46

    def decode(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
        _, *rest = real(*args, **kwargs)
        return (rates, *rest)

    monkeypatch.setattr(measure_module, "_decode", decode)
    settings = Settings(Batching(TOKENS, 16, 2), (0,), (HostMemoryMode.PINNED,), repeats=len(rates))
    with expertstream.backend("sim", data=False) as sim, MoeModel.open(tiny_path) as model:
        (row,) = measure(sim, sim.device(0), model, settings, h2d_peak=PeakProbe(10.0, 10.0, 10.0, 1)).rows
    assert row.decode_tokens_per_s == pytest.approx(30.0, rel=1e-12)
    assert row.decode_tokens_per_s_sd == pytest.approx(700.0**0.5, rel=1e-12)


def test_the_baseline_keeps_the_page_cache_for_rows_that_read_mode_disk(
    tiny_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def rows(*modes: HostMemoryMode) -> Settings:
        return Settings(Batching(TOKENS, 16), (0,), modes)

    with MoeModel.open(tiny_path) as model:
        monkeypatch.setattr(measure_module, "model_too_big", lambda model: None)
        assert measure_module._rows_read_disk(rows(HostMemoryMode.PINNED, HostMemoryMode.DISK), model)
        assert not measure_module._rows_read_disk(rows(HostMemoryMode.PREFERRED, HostMemoryMode.RING), model)
        # The preferred rule takes mode disk where the tensors do not fit.
        monkeypatch.setattr(measure_module, "model_too_big", lambda model: "too big")
        assert measure_module._rows_read_disk(rows(HostMemoryMode.PREFERRED), model)
        assert not measure_module._rows_read_disk(rows(HostMemoryMode.PINNED), model)
