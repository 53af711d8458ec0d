"""The scheduler's public rules against what it does: device_footprint and is_prefill_scale."""

from __future__ import annotations

import dataclasses

import pytest

import expertstream
from expertstream.backends.base import Backend, Device, HostMemory
from expertstream.scheduler import (
    DEFAULT_PREFILL_FACTOR,
    Scheduler,
    device_footprint,
    is_prefill_scale,
    prefetch_footprint,
)

from . import plans

N_LAYERS = 8  # as many as the most slots: every slot is allocated


def _padded(device: Device, spec: plans.LayerSpec) -> int:
    return device.alloc_size(
        spec.n_expert * spec.rows * plans.row_size(spec.row_type, spec.ne0), spec.row_type, spec.ne0
    )


def _allocated_by_run(backend: Backend, built: plans.BuiltPlan, slots: int) -> int:
    """Device bytes a fresh Scheduler(slots=slots) holds after running ``built`` (the simulator counts exactly)."""
    device = backend.device(0)
    free_before = device.free_memory()
    with Scheduler(slots=slots) as sched:
        sched.run(built.plan)
        built.check()
        held = free_before - device.free_memory()
    assert device.free_memory() == free_before, "close() gives every byte back"
    return held


@pytest.mark.parametrize("slots", [0, 2, 3, 8])
@pytest.mark.parametrize("host", [HostMemory.PINNED, HostMemory.PAGEABLE])
def test_a_prefill_run_allocates_its_slots_or_else_the_stock_scratch(slots: int, host: HostMemory) -> None:
    with expertstream.backend("sim") as backend:
        specs = plans.uniform_specs(N_LAYERS, host=host)
        built = plans.build(backend, specs, seed=51)
        largest = max(_padded(backend.device(0), spec) for spec in specs)
        allocated = _allocated_by_run(backend, built, slots)
        # A prefetched input's stock scratch is grown only if its slot is lost: the slots alone.
        assert allocated == (prefetch_footprint(slots, largest) if slots else device_footprint(0, largest))
        assert allocated <= device_footprint(slots, largest)
        built.close()


@pytest.mark.parametrize("slots", [0, 2, 3])
def test_device_footprint_counts_a_scratch_per_host_input_of_a_split(slots: int) -> None:
    with expertstream.backend("sim") as backend:
        specs = plans.uniform_specs(N_LAYERS)
        # Each split reads two tensors; the largest shape (every fourth spec) comes first in the
        # first half and second in the other, so that each scratch grows to it.
        pairs = [specs[i : i + 2] if i < N_LAYERS // 2 else specs[i + 1 : i - 1 : -1] for i in range(0, N_LAYERS, 2)]
        built = plans.build_splits(backend, pairs, seed=52)
        largest = max(_padded(backend.device(0), spec) for spec in specs)
        # Two slots leave room to prefetch one input a split: the other takes the stock copy.
        stock_inputs = {0: 2, 2: 1, 3: 0}[slots]
        expected = prefetch_footprint(slots, largest) + stock_inputs * largest
        assert _allocated_by_run(backend, built, slots) == expected
        assert expected <= device_footprint(slots, largest, host_inputs_per_split=2)
        built.close()


def test_device_footprint_sizes_by_the_streamed_inputs_only() -> None:
    with expertstream.backend("sim") as backend:
        device = backend.device(0)
        specs = plans.uniform_specs(N_LAYERS)
        largest = max(_padded(device, spec) for spec in specs)
        mixed = [dataclasses.replace(s, resident=_padded(device, s) == largest) for s in specs]
        built = plans.build(backend, mixed, seed=53)
        streamed_largest = max(_padded(device, s) for s in mixed if not s.resident)
        assert streamed_largest < largest
        assert _allocated_by_run(backend, built, 3) == prefetch_footprint(3, streamed_largest)
        built.close()


@pytest.mark.parametrize("prefill_factor", [1, DEFAULT_PREFILL_FACTOR, 3])
def test_is_prefill_scale_is_where_the_scheduler_starts_to_prefetch(prefill_factor: int) -> None:
    n_expert = 4
    with expertstream.backend("sim") as backend:
        for n_ids in range(1, 4 * n_expert + 1):
            specs = [dataclasses.replace(s, n_ids=n_ids) for s in plans.uniform_specs(4)]
            built = plans.build(backend, specs, seed=54)
            with Scheduler(slots=2, prefill_factor=prefill_factor) as sched:
                stats = sched.run(built.plan)
            built.check()
            built.close()
            prefetched = stats.total("fires") == len(specs)
            assert prefetched == is_prefill_scale(n_ids, n_expert, prefill_factor), n_ids
            assert prefetched == (n_ids >= prefill_factor * n_expert), n_ids


def test_is_prefill_scale_defaults_to_the_schedulers_factor() -> None:
    with Scheduler() as sched:
        assert sched.prefill_factor == DEFAULT_PREFILL_FACTOR == 2
    assert is_prefill_scale(2 * 8, 8) and not is_prefill_scale(2 * 8 - 1, 8)
