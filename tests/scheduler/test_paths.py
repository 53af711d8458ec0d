"""Paths a plain run never takes, on every usable backend: each must give the stock bytes and leave no trace."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from expertstream.backends.base import Backend, Device, HostMemory, Usage
from expertstream.errors import InvalidArgument, OutOfDeviceMemory
from expertstream.scheduler import Fallback, HostRegion, Input, Plan, RunStats, Scheduler

from . import plans

SLOT_COUNTS = (0, 2, 3, 8)


def _spec(host: HostMemory = HostMemory.PINNED, *, resident: bool = False, device: int = 0) -> plans.LayerSpec:
    return plans.LayerSpec(device, 4, 2, 768, Q.Q4_0, 8, host, resident)  # prefill scale: 8 ids, 4 experts


@contextmanager
def _failing_alloc(device: Device, failing: set[int]) -> Iterator[list[int]]:
    """Make the listed calls of ``device.alloc`` (counted from 1) fail as a full device would."""
    calls: list[int] = []
    real = device.alloc

    def alloc(nbytes: int, *args: Any, **kwargs: Any) -> Any:
        calls.append(nbytes)
        if len(calls) in failing:
            raise OutOfDeviceMemory(
                f"cannot allocate {nbytes} bytes (injected)", call="Device.alloc", device=device.label
            )
        return real(nbytes, *args, **kwargs)

    device.alloc = alloc  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        del device.alloc


def _settled_free_memory(backend: Backend, cycle: Callable[[], None]) -> tuple[int, int]:
    """Free device memory after one ``cycle`` (kernels loaded, first-use costs paid) and after another."""
    device = backend.device(0)
    cycle()
    device.synchronize()
    baseline = device.free_memory()
    cycle()
    device.synchronize()
    return baseline, device.free_memory()


# -- more eligible inputs in a split than slots ------------------------------------------------


@pytest.mark.parametrize("slots", [2, 3, 8])
def test_too_many_inputs_take_the_stock_path(backend: Backend, slots: int, caplog: pytest.LogCaptureFixture) -> None:
    inputs_per_split, n_splits = 4, 5
    built = plans.build_splits(backend, [[_spec()] * inputs_per_split for _ in range(n_splits)], seed=31)
    try:
        with Scheduler(slots=slots) as sched, caplog.at_level(logging.WARNING, "expertstream.scheduler"):
            for _ in range(2):
                stats = sched.run(built.plan).device(backend.device(0).label)
        built.check()
        room = slots - 1  # one slot is always the computing split's
        prefetched = min(inputs_per_split, room)
        assert stats.consumed == stats.fires == n_splits * prefetched
        assert stats.fallbacks[Fallback.TOO_MANY_INPUTS] == n_splits * (inputs_per_split - prefetched)
        assert stats.stock_copies == n_splits * (inputs_per_split - prefetched)
        said = [r for r in caplog.records if "too_many_inputs" in r.getMessage()]
        assert len(said) == (1 if prefetched < inputs_per_split else 0)  # once, over both runs
    finally:
        built.close()


# -- zero-sized tensors ------------------------------------------------------------------------


@pytest.mark.parametrize("slots", SLOT_COUNTS)
def test_zero_sized_tensors_bind_their_padded_size(backend: Backend, slots: int) -> None:
    device = backend.device(0)
    built = plans.build(backend, plans.uniform_specs(3), seed=32)
    empty_host, empty_device = device.wrap_host(np.zeros(0, dtype=np.uint8)), device.alloc(0)
    padding = device.alloc_size(0, Q.Q4_0, 768)  # a Q4_0 row of 768 elements reads 144 bytes past its end
    probes = [device.alloc(padding) for _ in built.plan.splits]
    seen: list[dict[str, int]] = []
    splits = []
    for split, probe in zip(built.plan.splits, probes, strict=True):
        extra = (
            Input("empty", 0, host=HostRegion(empty_host, 0, 0), usage=Usage.ANY),
            Input("empty_q4", 0, host=HostRegion(empty_host, 0, 0), usage=Usage.ANY, row_type=Q.Q4_0, ne0=768),
            Input("empty_resident", 0, device_data=empty_device.view(), usage=Usage.ANY),
        )

        def compute(stream, bindings, *, inner=split.compute, probe=probe):  # type: ignore[no-untyped-def]
            seen.append({name: view.nbytes for name, view in bindings.items()})
            tail = bindings["empty_q4"]
            stream.copy_d2d(probe, 0, tail.buffer, tail.offset, tail.nbytes)
            inner(stream, bindings)

        splits.append(dataclasses.replace(split, inputs=split.inputs + extra, compute=compute))
    try:
        with Scheduler(slots=slots) as sched:
            sched.run(Plan.of(splits))
        built.check()
        assert [{k: v for k, v in s.items() if k != "w"} for s in seen] == [
            {"empty": 0, "empty_q4": padding, "empty_resident": 0}
        ] * 3
        if backend.host.holds_data:
            assert all(not probe.read().any() for probe in probes)  # the padding kernels read is zero
    finally:
        for buf in [*probes, empty_device, empty_host]:
            buf.close()
        built.close()


def test_zero_sized_expert_weights_are_refused(backend: Backend) -> None:
    host = backend.device(0).wrap_host(np.zeros(0, dtype=np.uint8))
    with pytest.raises(InvalidArgument, match="expert size 0"):
        Input("w", 0, host=HostRegion(host, 0, 0), expert_nbytes=0)


# -- device and host inputs mixed across many splits -------------------------------------------


def _mixed_splits(backend: Backend, n_splits: int, seed: int) -> list[list[plans.LayerSpec]]:
    rng = np.random.default_rng(seed)
    kinds = [("resident", None), ("host", HostMemory.PINNED), ("host", HostMemory.PAGEABLE)]
    if backend.device(0).capabilities.host_register:
        kinds.append(("host", HostMemory.REGISTERED))
    splits = []
    for index in range(n_splits):
        device = index % len(backend.devices)
        chosen = [kinds[int(k)] for k in rng.integers(0, len(kinds), int(rng.integers(1, 4)))]
        splits.append(
            [_spec(host or HostMemory.PINNED, resident=where == "resident", device=device) for where, host in chosen]
        )
    return splits


@pytest.mark.parametrize("slots", SLOT_COUNTS)
def test_device_and_host_inputs_mixed_across_many_splits(backend: Backend, slots: int) -> None:
    layout = _mixed_splits(backend, 16, seed=33)
    built = plans.build_splits(backend, layout, seed=33)
    try:
        with Scheduler(slots=slots) as sched:
            stats = sched.run(built.plan)
            built.check()
            again = sched.run(built.plan)  # slots and scratch reused as they are
            built.check()
        host_inputs = [sum(not spec.resident for spec in split) for split in layout]
        room = slots - 1 if slots else 0
        expected = sum(min(n, room) for n in host_inputs)
        for result in (stats, again):
            assert result.total("consumed") == result.total("fires") == expected
            assert result.total("stock_copies") == sum(host_inputs) - expected
    finally:
        built.close()


# -- memory back to its baseline -------------------------------------------------------------


@pytest.mark.parametrize("host", [HostMemory.PINNED, HostMemory.PAGEABLE], ids=lambda h: h.value)
def test_device_memory_returns_to_its_baseline_after_close(backend: Backend, host: HostMemory) -> None:
    def cycle() -> None:
        built = plans.build(backend, plans.uniform_specs(6, host=host), seed=34)
        with Scheduler(slots=3) as sched:
            for slots in (3, 8, 2, 0, 4):
                sched.slots = slots
                sched.run(built.plan)
        built.close()

    baseline, after = _settled_free_memory(backend, cycle)
    assert after == baseline


# -- scratch allocation failing ----------------------------------------------------------------


@pytest.mark.parametrize("slots", [0, 3])
def test_a_failed_scratch_allocation_raises_and_the_next_run_works(backend: Backend, slots: int) -> None:
    device = backend.device(0)

    def cycle() -> None:
        # Two inputs per split: two scratch buffers, the second of which cannot be allocated.
        built = plans.build_splits(backend, [[_spec(), _spec(HostMemory.PAGEABLE)] for _ in range(4)], seed=35)
        with Scheduler(slots=slots) as sched:
            with _failing_alloc(device, {2}) as calls, pytest.raises(OutOfDeviceMemory, match="injected"):
                sched.run(built.plan)
            assert len(calls) == 2  # nothing else was allocated after the failure
            stats = sched.run(built.plan)
            built.check()
            assert stats.total("consumed") == (4 * 2 if slots else 0)
        built.close()

    baseline, after = _settled_free_memory(backend, cycle)
    assert after == baseline


# -- a compute function that raises mid-run ----------------------------------------------------


class _Boom(Exception):
    pass


@pytest.mark.parametrize("host", [HostMemory.PINNED, HostMemory.PAGEABLE], ids=lambda h: h.value)
@pytest.mark.parametrize("slots", [0, 2, 3])
def test_a_compute_function_that_raises_leaves_the_scheduler_usable(
    backend: Backend, slots: int, host: HostMemory
) -> None:
    def cycle() -> None:
        built = plans.build(backend, plans.uniform_specs(7, host=host), seed=36)
        raised = {"left": 1}

        def failing(stream, bindings, *, inner=built.plan.splits[3].compute):  # type: ignore[no-untyped-def]
            inner(stream, bindings)
            if raised["left"]:
                raised["left"] -= 1
                raise _Boom("compute failed after enqueuing its kernels")

        splits = list(built.plan.splits)
        splits[3] = dataclasses.replace(splits[3], compute=failing)
        plan = Plan.of(splits)
        with Scheduler(slots=slots) as sched:
            before = sched.last_stats
            with pytest.raises(_Boom):
                sched.run(plan)
            assert sched.last_stats is before  # a failed run reports nothing
            stats = sched.run(plan)
            built.check()
            dev = stats.device(backend.device(0).label)
            assert dev.consumed == dev.fires == (7 if slots else 0)
            assert not dev.fallbacks
        built.close()

    baseline, after = _settled_free_memory(backend, cycle)
    assert after == baseline


# -- two schedulers on one device, from two host threads at once ------------------------------


def test_two_schedulers_on_one_device_from_two_threads(backend: Backend) -> None:
    jobs = {
        "pinned": (plans.build(backend, plans.uniform_specs(6, host=HostMemory.PINNED), seed=37), 3),
        "pageable": (plans.build(backend, plans.uniform_specs(6, host=HostMemory.PAGEABLE), seed=38), 2),
    }
    start = threading.Barrier(len(jobs))
    results: dict[str, list[RunStats]] = {}
    errors: list[BaseException] = []
    built_at = backend.host.timestamp()  # what the threads must know: the plans' uploads are done
    finished: list[float] = []  # and what this thread must know: the threads' runs are done

    def work(name: str) -> None:
        built, slots = jobs[name]
        try:
            backend.host.resume_at(built_at)
            with Scheduler(slots=slots) as sched:
                start.wait()
                results[name] = [sched.run(built.plan) for _ in range(3)]
            finished.append(backend.host.timestamp())
        except BaseException as exc:
            start.abort()  # the other thread must not wait for this one forever
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(name,)) for name in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for stamp in finished:
        backend.host.resume_at(stamp)
    try:
        assert not errors, errors
        label = backend.device(0).label
        for name, (built, _slots) in jobs.items():
            built.check()
            assert [r.device(label).consumed for r in results[name]] == [6, 6, 6]
            assert [r.device(label).bytes_stock for r in results[name]] == [0, 0, 0]
    finally:
        for built, _slots in jobs.values():
            built.close()
