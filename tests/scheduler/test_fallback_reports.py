"""What the scheduler tells its user when something fails: the one warning, the stats, errors not lost."""

from __future__ import annotations

import dataclasses
import logging

import pytest

import expertstream
from expertstream.backends.base import Backend, HostMemory
from expertstream.backends.sim.profiles import resolve_profile
from expertstream.errors import DeviceError, OutOfDeviceMemory
from expertstream.scheduler import Fallback, Plan, Scheduler, slot_sizes
from expertstream.scheduler.stats import DeviceStats, RunStats

from . import plans


def _fail_second_slot(backend: Backend, monkeypatch: pytest.MonkeyPatch, asked: list[int]) -> None:
    device = backend.device(0)
    real_alloc = device.alloc

    def second_slot_fails(n, *args, **kwargs):  # type: ignore[no-untyped-def]
        asked.append(n)
        if len(asked) == 2:
            raise OutOfDeviceMemory(f"cannot allocate {n} bytes", call="alloc", device=device.label)
        return real_alloc(n, *args, **kwargs)

    monkeypatch.setattr(device, "alloc", second_slot_fails)


def _warnings_of_a_failed_slot(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, asked: list[int]
) -> tuple[list[str], RunStats]:
    """Run a plan whose second prefetch slot cannot be allocated; ``asked`` gets the sizes asked for."""
    built = plans.build(backend, plans.uniform_specs(6), seed=31)
    with Scheduler(slots=0) as sched:
        sched.run(built.plan)  # scratch exists now: every later allocation is a prefetch slot
        sched.slots = 3
        _fail_second_slot(backend, monkeypatch, asked)
        with caplog.at_level(logging.WARNING, logger="expertstream.scheduler"):
            stats = sched.run(built.plan)
        built.check()
    built.close()
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING], stats


def test_the_turn_off_warning_names_device_slot_bytes_free_memory_and_cause(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    device = backend.device(0)
    monkeypatch.setattr(device, "free_memory", lambda: 12345)
    asked: list[int] = []
    warnings, stats = _warnings_of_a_failed_slot(backend, monkeypatch, caplog, asked)
    assert warnings == [
        f"{device.label}: lookahead prefetch turned off: allocating prefetch slot 2 of 3 ({asked[1]} bytes) failed "
        f"with 12345 bytes free (cannot allocate {asked[1]} bytes); using the stock copy path"
    ]
    assert stats.device(device.label).fallbacks == {Fallback.ALLOC_FAILED: 1, Fallback.DISABLED: 4}
    assert stats.as_dict()[device.label]["fallbacks"] == {"alloc_failed": 1, "disabled": 4}


def test_the_turn_off_warning_says_when_free_memory_is_unknown(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    device = backend.device(0)
    real_free_memory = device.free_memory

    asked: list[int] = []

    def no_answer_once_an_alloc_failed() -> int:  # the simulator's own allocations ask it too
        if len(asked) >= 2:
            raise DeviceError("the driver does not say", call="free_memory", device=device.label)
        return real_free_memory()

    monkeypatch.setattr(device, "free_memory", no_answer_once_an_alloc_failed)
    warnings, _stats = _warnings_of_a_failed_slot(backend, monkeypatch, caplog, asked)
    assert len(warnings) == 1 and "failed with free memory unknown (cannot allocate" in warnings[0]


def test_ready_waits_are_timed_or_counted_as_untimed(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    device = backend.device(0)
    built = plans.build(backend, plans.uniform_specs(6), seed=32)
    with Scheduler(slots=3) as sched:
        timed = sched.run(built.plan).device(device.label)
    built.check()
    real_event = device.event

    def no_timing_events(timing: bool = False):  # type: ignore[no-untyped-def]
        if timing:
            raise OutOfDeviceMemory("no more events", call="event", device=device.label)
        return real_event(timing)

    monkeypatch.setattr(device, "event", no_timing_events)
    with Scheduler(slots=3) as sched:
        untimed = sched.run(built.plan).device(device.label)
    built.check()
    assert timed.consumed == 6 and timed.untimed_waits == 0
    assert untimed.consumed == 6 and untimed.untimed_waits == 6 and untimed.ready_wait_ms == 0.0
    built.close()


def test_a_copy_failing_on_the_worker_while_the_run_fails_is_logged_not_lost(
    backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    built = plans.build(backend, plans.uniform_specs(4, host=HostMemory.PAGEABLE), seed=33)
    counter = {"n": 0}

    def compute_fails(stream, bindings) -> None:  # type: ignore[no-untyped-def]
        raise RuntimeError("the compute function failed")

    splits = []
    for index, split in enumerate(built.plan.splits):
        inputs = tuple(
            dataclasses.replace(inp, host=plans.FailingSource(inp.host, counter, fail_on=2)) for inp in split.inputs
        )
        compute = compute_fails if index == 0 else split.compute
        splits.append(dataclasses.replace(split, inputs=inputs, compute=compute))
    # Split 1's copy was handed to the worker before split 0 ran; it fails while the run unwinds.
    with (
        Scheduler(slots=3) as sched,
        caplog.at_level(logging.ERROR, logger="expertstream.scheduler"),
        pytest.raises(RuntimeError, match="compute function failed"),
    ):
        sched.run(Plan.of(splits))
    assert [r.getMessage() for r in caplog.records] == ["while draining after an error: the weights file went away"]
    built.close()


def test_stats_as_dict_names_fallbacks_by_their_values() -> None:
    stats = DeviceStats("sim:0", fires=2)
    stats.fallbacks[Fallback.TOO_MANY_INPUTS] += 3
    out = stats.as_dict()
    assert out["device"] == "sim:0" and out["fires"] == 2
    assert out["fallbacks"] == {"too_many_inputs": 3}


def test_a_failing_compute_function_is_the_one_error_seen(backend: Backend, caplog: pytest.LogCaptureFixture) -> None:
    built = plans.build(backend, plans.uniform_specs(4), seed=34)

    def compute_fails(stream, bindings) -> None:  # type: ignore[no-untyped-def]
        raise RuntimeError("the compute function failed")

    splits = [dataclasses.replace(s, compute=compute_fails) if i == 1 else s for i, s in enumerate(built.plan.splits)]
    with (
        Scheduler(slots=3) as sched,
        caplog.at_level(logging.DEBUG, logger="expertstream.scheduler"),
        pytest.raises(RuntimeError, match="compute function failed"),
    ):
        sched.run(Plan.of(splits))
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    built.close()


def test_an_error_while_draining_a_run_is_raised_and_the_stats_kept(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    device = backend.device(0)
    built = plans.build(backend, plans.uniform_specs(2), seed=35)
    with Scheduler(slots=0) as sched:
        stats = sched.run(built.plan)  # the scratch exists: the next run syncs only when it drains
        assert sched.last_stats is stats
        compute = sched.stream(device)
        real_synchronize = compute.synchronize
        calls = {"n": 0}

        def fails_once() -> None:
            calls["n"] += 1
            if calls["n"] == 1:
                raise DeviceError("the device fell off the bus", call="synchronize", device=device.label)
            real_synchronize()

        monkeypatch.setattr(compute, "synchronize", fails_once)
        with pytest.raises(DeviceError, match="fell off the bus"):
            sched.run(built.plan)
        assert sched.last_stats is stats, "a run that failed leaves the last good run's stats"
    built.close()


def test_inputs_whose_slots_are_lost_grow_the_stock_scratch_they_fall_back_to(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run whose prefetch works holds no stock scratch for prefetched inputs; a fresh scheduler
    whose slot cannot be allocated grows it at the first stock copy, and the outputs stay right."""
    device = backend.device(0)
    built = plans.build(backend, plans.uniform_specs(6), seed=33)
    largest = max(inp.padded_nbytes for split in built.plan.splits for inp in split.inputs)
    asked: list[int] = []
    with Scheduler(slots=3) as sched:
        _fail_second_slot(backend, monkeypatch, asked)  # the stock scratch's (empty), then the first slot's
        stats = sched.run(built.plan)
        built.check()
        held = sched.device_bytes()
    assert asked[0] == 0 and asked[1] == largest
    dev = stats.device(device.label)
    assert dev.fallbacks[Fallback.ALLOC_FAILED] == 1 and dev.stock_copies == 6
    assert held == largest, "the slots are gone; the stock scratch grew to the largest input"
    built.close()


def test_a_device_without_room_for_every_slot_gives_the_stock_copies_the_slots_no_split_reads() -> None:
    """Room for three slots and a half: the fourth cannot be allocated, and a stock scratch beside
    the three would not fit either; the lost prefetch's slots no split reads any more make room."""
    specs = plans.uniform_specs(6)
    profile = resolve_profile("cuda-h200")
    with expertstream.backend("sim", profile=profile) as roomy:
        device = roomy.device(0)
        before = device.free_memory()
        built = plans.build(roomy, specs, seed=34)
        plan_bytes = before - device.free_memory()
        sizes = slot_sizes(4, [inp.padded_nbytes for split in built.plan.splits for inp in split.inputs])
        built.close()
    tight = dataclasses.replace(profile, memory_bytes=plan_bytes + sum(sizes[:3]) + sizes[3] // 2)
    with expertstream.backend("sim", profile=tight) as backend, Scheduler(slots=4) as sched:
        built = plans.build(backend, specs, seed=34)
        stats = sched.run(built.plan)
        built.check()
        built.close()
    dev = stats.device(backend.device(0).label)
    assert dev.fallbacks[Fallback.ALLOC_FAILED] == 1
    assert dev.consumed > 0 and dev.stock_copies == len(specs) - dev.consumed
