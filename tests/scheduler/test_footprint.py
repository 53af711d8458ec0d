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
    slot_sizes,
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
        sizes = [_padded(backend.device(0), spec) for spec in specs]
        allocated = _allocated_by_run(backend, built, slots)
        # A prefetched input's stock scratch is grown only if its slot is lost: the slots alone,
        # each sized for the largest input it holds.
        assert allocated == (sum(slot_sizes(slots, sizes)) if slots else device_footprint(0, max(sizes)))
        assert allocated <= device_footprint(slots, max(sizes))
        if slots:  # the shapes differ: slots that never hold the largest are smaller than it
            assert allocated < prefetch_footprint(slots, max(sizes))
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
        fired = [_padded(backend.device(0), spec) for pair in pairs for spec in pair[: 2 - stock_inputs]]
        expected = (sum(slot_sizes(slots, fired)) if slots else 0) + stock_inputs * largest
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
        streamed = [_padded(device, s) for s in mixed if not s.resident]
        assert max(streamed) < largest
        assert _allocated_by_run(backend, built, 3) == sum(slot_sizes(3, streamed))
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


def test_each_slot_is_sized_for_the_largest_input_it_holds() -> None:
    # A layer streaming a gate, an up and a larger down tensor through three slots.
    gate, up, down = 113, 113, 165
    assert slot_sizes(3, [gate, up, down] * 4) == [gate, up, down]
    assert slot_sizes(2, [gate, up, down] * 4) == [down, down]
    assert slot_sizes(4, [gate, up]) == [gate, up, 0, 0]  # slots no input goes to are never allocated
    assert slot_sizes(3, []) == [0, 0, 0]


def test_a_kept_scheduler_grows_only_the_slots_a_later_run_needs_larger() -> None:
    with expertstream.backend("sim") as backend:
        device = backend.device(0)
        specs = plans.uniform_specs(4)
        small = [specs[1], specs[3]]  # each slot first holds one of the two smaller tensors
        large = [specs[1], specs[0]]  # then slot 1 must hold the largest
        free_before = device.free_memory()
        with Scheduler(slots=2) as sched:
            held = []
            for layer_specs, seed in ((small, 55), (large, 56), (small, 57)):
                built = plans.build(backend, layer_specs, seed=seed)
                sched.run(built.plan)
                built.check()  # the grown slot holds the right bytes, the kept one too
                held.append(sched._prefetch[device].device_bytes)
                built.close()
            sizes = [_padded(device, s) for s in specs]
            assert held[0] == sizes[1] + sizes[3]
            assert held[1] == held[2] == sizes[1] + sizes[0]  # slot 0 kept, slot 1 grown, then kept
        assert device.free_memory() == free_before
