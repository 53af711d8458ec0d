"""Prefill and decode through the scheduler give the same bytes whatever the slots and host memory."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

import expertstream
from expertstream.backends.base import Backend
from expertstream.bench.measure import Settings, measure, measure_compute_only
from expertstream.bench.report import format_table
from expertstream.engine.runner import Batching, MoeRunner, embeddings, sha256, stand_in_routing
from expertstream.errors import InvalidArgument
from expertstream.ggml import padded_size
from expertstream.hostmem import HostMemoryMode, HostWeights, RingOptions
from expertstream.model import MoeModel
from expertstream.scheduler import Scheduler
from expertstream.scheduler.stock import expert_ranges

# Two ubatches, so the lookahead crosses a ubatch boundary; 16 tokens x top-2 = 32 ids >= 2 x 8
# experts: prefill scale.
PREFILL = Batching(tokens=32, ubatch=16)
MODES = (HostMemoryMode.MMAP, HostMemoryMode.REGISTERED, HostMemoryMode.PINNED, HostMemoryMode.RING)
SMALL_RING = RingOptions(chunk_bytes=60_000, chunks=3, threads=2)


def _prefill(runner: MoeRunner, weights: HostWeights, slots: int) -> tuple[np.ndarray, int]:
    with Scheduler(slots=slots) as scheduler:
        stats = scheduler.run(runner.prefill_plan(weights))
    return runner.prefill_output(), int(stats.total("fires"))


def test_prefill_is_identical_for_every_slot_count_and_host_memory(backend: Backend, tiny_path: Path) -> None:
    device = backend.device(0)
    hashes: dict[tuple[str, int], str] = {}
    with MoeModel.open(tiny_path) as model, MoeRunner(device, model, PREFILL) as runner:
        for mode in MODES:
            with HostWeights.open(model, device, mode, ring=SMALL_RING) as weights:
                for slots in (0, 2, 3, 4):
                    output, fires = _prefill(runner, weights, slots)
                    assert np.isfinite(output).all(), (mode, slots)
                    # 2 ubatches x 2 layers x 3 expert tensors, each copied ahead when slots > 0
                    assert fires == (12 if slots else 0), (mode, slots)
                    hashes[(weights.mode.value, slots)] = sha256(output)
        _, all_layers, resident = measure_compute_only(backend, runner, warmup=False)
    assert all_layers
    assert set(hashes.values()) == {resident}, hashes


def test_fused_gate_up_gives_the_same_bytes_in_fewer_splits(backend: Backend, tiny_path: Path) -> None:
    device = backend.device(0)
    with (
        MoeModel.open(tiny_path) as model,
        HostWeights.open(model, device, "pinned") as weights,
        MoeRunner(device, model, PREFILL) as plain,
        MoeRunner(device, model, PREFILL, fuse_gate_up=True) as fused,
    ):
        if not fused.fuses_gate_up():
            pytest.skip(f"{device.label} has no direct kernel for {model.layers[0].gate.qtype.name}")
        assert not plain.fuses_gate_up()
        names = [s.name.split(".")[0] for s in fused.prefill_plan(weights).splits]
        assert names.count("gate_up") == 4 and "gate" not in names and "up" not in names
        for slots in (0, 3):
            with Scheduler(slots=slots) as scheduler:
                stats = scheduler.run(fused.prefill_plan(weights))
            assert not any(d.fallbacks for d in stats.devices.values()), stats
            assert sha256(fused.prefill_output()) == sha256(_prefill(plain, weights, slots)[0])


def test_outputs_depend_on_the_inputs(backend: Backend, tiny_path: Path) -> None:
    device = backend.device(0)
    with MoeModel.open(tiny_path) as model, HostWeights.open(model, device, "pinned") as weights:
        digests = set()
        for seed in (0, 1):
            with MoeRunner(device, model, PREFILL, seed=seed) as runner:
                output, _ = _prefill(runner, weights, 3)
                digests.add(sha256(output))
                # each layer adds its MoE output to the hidden state: the result is not the input
                assert not np.allclose(output, embeddings(seed, 0, PREFILL.tokens, model.n_embd), atol=1e-3)
    assert len(digests) == 2


def test_decode_steps_are_identical_with_and_without_slots_and_gathers(backend: Backend, tiny_path: Path) -> None:
    device = backend.device(0)
    batching = Batching(tokens=16, ubatch=16, decode_steps=50)
    outputs = {}
    with MoeModel.open(tiny_path) as model, MoeRunner(device, model, batching) as runner:
        expert_bytes = sum(t.nbytes for t in model.expert_tensors)
        with HostWeights.open(model, device, "registered") as weights:
            for slots, gather in ((0, True), (3, True), (0, False)):
                with Scheduler(slots=slots, gather=gather) as scheduler:
                    scheduler.run(runner.prefill_plan(weights))  # leaves slots allocated, as a long-lived process would
                    for step in range(batching.decode_steps):
                        stats = scheduler.run(runner.decode_plan(weights, step))
                        assert stats.total("fires") == 0, "decode keeps the stock path"
                        if gather:  # the device copies the used experts itself: no ids read back
                            assert stats.total("gathers") == 3 * len(model.layers)
                            assert stats.total("ids_readbacks") == stats.total("bytes_stock") == 0
                        else:
                            assert 0 < stats.total("bytes_stock") < expert_bytes, "only used experts are copied"
                outputs[slots, gather] = runner.decode_output()
    assert np.isfinite(outputs[0, True]).all()
    assert len({sha256(out) for out in outputs.values()}) == 1
    assert len({sha256(row) for row in outputs[0, True]}) == batching.decode_steps


@pytest.mark.parametrize("mode", ["registered", "pinned"])
def test_a_replayed_decode_step_gives_the_bits_of_the_step_by_step_plan(
    backend: Backend, tiny_path: Path, mode: str
) -> None:
    device = backend.device(0)
    batching = Batching(tokens=8, ubatch=8, decode_steps=6)
    outputs = []
    with (
        MoeModel.open(tiny_path) as model,
        MoeRunner(device, model, batching) as runner,
        HostWeights.open(model, device, mode) as weights,
        Scheduler() as scheduler,
    ):
        for step in range(batching.decode_steps):
            scheduler.run(runner.decode_plan(weights, step))
        outputs.append(runner.decode_output())
        with scheduler.capture(runner.decode_step_plan(weights)) as replay:
            stream = replay.stream
            stream.memset(runner._parts[0].decode_hidden, 0, runner._parts[0].decode_hidden.nbytes, 0)
            for step in range(batching.decode_steps):
                runner.decode_step_in(stream, step)
                replay.launch()
                runner.decode_step_out(stream, step)
                stats = replay.finish()
                assert stats.total("gathers") == 3 * len(model.layers) and stats.total("ids_readbacks") == 0
            outputs.append(runner.decode_output())
    assert np.isfinite(outputs[0]).all()
    assert sha256(outputs[0]) == sha256(outputs[1])


def test_bad_batching_and_steps_are_named(backend: Backend, tiny_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="ubatch >= 1"):
        Batching(tokens=8, ubatch=0)
    with (
        MoeModel.open(tiny_path) as model,
        MoeRunner(backend.device(0), model, Batching(8, 8, 2)) as runner,
        pytest.raises(InvalidArgument, match=r"decode step 2 is outside 0..1"),
    ):
        runner.decode_plan({}, 2)


def test_timing_only_decode_copies_the_stand_in_experts(tiny_path: Path) -> None:
    with (
        expertstream.backend("sim", data=False) as backend,
        MoeModel.open(tiny_path) as model,
        MoeRunner(backend.device(0), model, Batching(4, 4, 3), seed=5) as runner,
        HostWeights.open(model, backend.device(0), "pinned") as weights,
        Scheduler(slots=3, gather=False) as scheduler,
    ):
        for step in range(3):
            stats = scheduler.run(runner.decode_plan(weights, step))
            used = [np.unique(stand_in_routing(5, 4 + step, 1, layer.index, model)) for layer in model.layers]
            expected = sum(
                end - start
                for layer, experts in zip(model.layers, used, strict=True)
                for info in (layer.gate, layer.up, layer.down)
                for start, end in expert_ranges(
                    experts,
                    info.slice_nbytes,
                    info.nbytes,
                    padded_size(info.nbytes, info.qtype, info.ne0) - info.nbytes,
                )
            )
            assert stats.total("bytes_stock") == expected
            assert stats.total("ids_readbacks") == len(model.layers)  # paid as on a GPU


def test_timing_only_decode_gathers_without_reading_ids_back(tiny_path: Path) -> None:
    with (
        expertstream.backend("sim", data=False) as backend,
        MoeModel.open(tiny_path) as model,
        MoeRunner(backend.device(0), model, Batching(4, 4, 1), seed=5) as runner,
        HostWeights.open(model, backend.device(0), "pinned") as weights,
        Scheduler(slots=3) as scheduler,
    ):
        stats = scheduler.run(runner.decode_plan(weights, 0))
        # One token: top_k distinct experts, packed one after another (no bytes past each).
        expected = sum(
            model.top_k * info.slice_nbytes for layer in model.layers for info in (layer.gate, layer.up, layer.down)
        )
        assert stats.total("bytes_gathered_at_most") == expected
        assert stats.total("ids_readbacks") == stats.total("bytes_stock") == 0


def test_rows_without_the_compute_only_baseline_leave_its_comparisons_empty(tiny_path: Path) -> None:
    """Settings.compute_only=False runs no compute-only plan; the rows' figures that compare to it are
    None, and the report prints them as "-" (tune times the job's rows and needs only their own)."""
    labels: list[str] = []
    settings = Settings(Batching(32, 16, 2), (0, 2), (HostMemoryMode.REGISTERED,), compute_only=False)
    with expertstream.backend("sim", data=False) as sim, MoeModel.open(tiny_path) as model:
        result = measure(sim, sim.device(0), model, settings, labels.append)
        with_baseline = measure(sim, sim.device(0), model, dataclasses.replace(settings, compute_only=True))
    assert not any(label.startswith("compute only") for label in labels)
    assert result.baselines.compute_only_s is result.baselines.compute_only_all_layers is None
    for row in result.rows:
        assert row.ttft_s > 0 and row.decode_tokens_per_s
        assert row.compute_only_s is row.overlap_efficiency is row.over_compute_ms is None
    # The rows themselves alike (virtual time, up to float rounding of where the clock stood).
    assert [r.ttft_s for r in result.rows] == pytest.approx([r.ttft_s for r in with_baseline.rows], rel=1e-9)
    assert all(r.overlap_efficiency and r.over_compute_ms is not None for r in with_baseline.rows)
    header, *lines = format_table(result.rows).splitlines()
    end = header.index("overlap") + len("overlap")  # cells are right-aligned under their names
    assert [line[end - 7 : end] for line in lines] == ["      -"] * len(result.rows)
    assert [line[end + 2 : end + 13] for line in lines] == ["          -"] * len(result.rows)  # +compute ms
