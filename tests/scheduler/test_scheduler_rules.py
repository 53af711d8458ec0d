"""The scheduler's settings, which inputs it prefetches, how far ahead it starts, and what it reports."""

from __future__ import annotations

import dataclasses
import logging
import threading

import numpy as np
import pytest

import expertstream
from expertstream.backends.base import Backend, HostMemory, Usage
from expertstream.errors import DeviceError
from expertstream.scheduler import Fallback, Input, Plan, Scheduler
from expertstream.scheduler.source import HostRegion
from expertstream.scheduler.stats import RunStats
from expertstream.timeline import OpKind

from . import plans
from .test_copy_paths import _recording


def test_setting_messages_and_limits() -> None:
    with pytest.raises(TypeError) as type_err:
        Scheduler(slots="3")  # type: ignore[arg-type]
    assert str(type_err.value) == "slots must be an int, got str"
    with pytest.raises(ValueError) as one:
        Scheduler(slots=1)
    assert str(one.value) == (
        "slots=1 cannot overlap a copy with compute and would overwrite the slot in use; use 0 or 2..8"
    )
    with pytest.raises(ValueError) as factor:
        Scheduler(prefill_factor=0)
    assert str(factor.value) == "prefill_factor must be >= 1, got 0"
    sched = Scheduler(prefill_factor=1)
    assert sched.prefill_factor == 1 and sched.last_stats == RunStats()


@pytest.mark.parametrize("slots", [2, 3, 4])
def test_the_first_copies_go_out_before_the_first_split_starts(slots: int) -> None:
    with expertstream.backend("sim") as backend:
        built = plans.build(backend, plans.uniform_specs(6), seed=51)
        with Scheduler(slots=slots) as sched:
            start = len(backend.timeline)
            sched.run(built.plan)
            ops = backend.timeline[start:]
        built.check()
        built.close()
    first_kernel = next(i for i, op in enumerate(ops) if op.kind is OpKind.KERNEL)
    copies_before = [op for op in ops[:first_kernel] if op.kind is OpKind.H2D]
    assert len(copies_before) == slots - 1, "N slots: the copies of splits 0..N-2 are in flight at the start"


def _with_extra_inputs(built: plans.BuiltPlan, backend: Backend, extra: int, usage: Usage, routed: bool):  # type: ignore[no-untyped-def]
    """Each split gets ``extra`` more host inputs of ``usage``, named in its routing or not."""
    device = backend.device(0)
    splits = []
    for index, split in enumerate(built.plan.splits):
        weights = split.inputs[0]
        more = []
        for k in range(extra):
            host = device.wrap_host(np.full(weights.nbytes, k + 1, dtype=np.uint8))
            built.resources.append(host)
            more.append(
                Input(
                    f"extra{k}",
                    weights.nbytes,
                    host=HostRegion(host, 0, weights.nbytes),
                    usage=usage,
                    row_type=weights.row_type,
                    ne0=weights.ne0,
                    expert_nbytes=weights.expert_nbytes,
                )
            )
        routing = split.mul_mat_id
        assert routing is not None
        if routed:
            routing = dataclasses.replace(routing, weights=(*routing.weights, *(m.name for m in more)))
        splits.append(dataclasses.replace(split, inputs=(weights, *more), mul_mat_id=routing, name=f"layer{index}"))
    return Plan.of(splits)


@pytest.mark.parametrize(("slots", "prefetched", "fallbacks"), [(2, 1, 2), (3, 2, 1), (4, 3, 0), (8, 3, 0)])
def test_a_split_with_more_expert_inputs_than_free_slots_streams_the_rest(
    backend: Backend, slots: int, prefetched: int, fallbacks: int
) -> None:
    built = plans.build(backend, plans.uniform_specs(4), seed=52)
    plan = _with_extra_inputs(built, backend, 2, Usage.WEIGHTS, routed=True)
    with Scheduler(slots=slots) as sched:
        dev = sched.run(plan).device(backend.device(0).label)
    built.check()
    assert dev.consumed == 4 * prefetched and dev.stock_copies == 4 * (3 - prefetched)
    assert dev.fallbacks[Fallback.TOO_MANY_INPUTS] == 4 * fallbacks
    built.close()


@pytest.mark.parametrize("usage", [Usage.WEIGHTS, Usage.ANY])
def test_only_routed_host_weights_are_prefetched(backend: Backend, usage: Usage) -> None:
    built = plans.build(backend, plans.uniform_specs(4), seed=53)
    plan = _with_extra_inputs(built, backend, 1, usage, routed=usage is Usage.ANY)
    with Scheduler(slots=3) as sched:
        dev = sched.run(plan).device(backend.device(0).label)
    built.check()
    assert dev.consumed == 4 and dev.stock_copies == 4, "the extra input is not a routed expert weight"
    built.close()


def test_device_resident_expert_weights_are_bound_not_prefetched(backend: Backend) -> None:
    specs = [dataclasses.replace(s, resident=True) for s in plans.uniform_specs(4)]
    built = plans.build(backend, specs, seed=54)
    with Scheduler(slots=3) as sched:
        dev = sched.run(built.plan).device(backend.device(0).label)
    built.check()
    assert dev.fires == 0 and dev.stock_copies == 0
    built.close()


def test_one_pageable_source_sends_a_devices_copies_through_the_worker(backend: Backend) -> None:
    hosts = [HostMemory.PAGEABLE, HostMemory.PINNED, HostMemory.PINNED, HostMemory.PINNED]
    specs = [dataclasses.replace(s, host=h) for s, h in zip(plans.uniform_specs(4), hosts, strict=True)]
    built = plans.build(backend, specs, seed=55)
    threads: list[threading.Thread] = []
    with Scheduler(slots=3) as sched:
        dev = sched.run(_recording(built.plan, threads)).device(backend.device(0).label)
    built.check()
    assert dev.consumed == 4 and threading.current_thread() not in threads
    built.close()


def test_a_run_synchronizes_its_compute_stream_once(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    device = backend.device(0)
    built = plans.build(backend, plans.uniform_specs(6), seed=56)
    with Scheduler(slots=3) as sched:
        sched.run(built.plan)
        compute = sched.stream(device)
        real_synchronize = compute.synchronize
        calls: list[int] = []
        monkeypatch.setattr(compute, "synchronize", lambda: calls.append(1) or real_synchronize())
        sched.run(built.plan)  # same slots, same sizes: nothing to drain before it starts
        assert len(calls) == 1, "only the drain at its end"
    built.check()
    built.close()


def test_a_decode_step_after_prefill_reports_no_ready_waits(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    device = backend.device(0)
    prefill = plans.build(backend, plans.uniform_specs(4), seed=57)
    decode = plans.build(backend, plans.uniform_specs(4, prefill=False), seed=58)
    monkeypatch.setattr(type(device.event(timing=True)), "elapsed_ms", lambda self, end: 2.0)
    with Scheduler(slots=3) as sched:
        assert sched.run(prefill.plan).device(device.label).ready_wait_ms == 8.0
        stats = sched.run(decode.plan).device(device.label)
    decode.check()
    assert stats.fires == 0 and stats.ready_wait_ms == 0.0
    prefill.close()
    decode.close()


def test_draining_errors_on_two_devices_raise_the_first_and_log_the_second(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with expertstream.backend("sim", devices=2, peer_access=True) as backend:
        specs = [dataclasses.replace(s, device=i % 2) for i, s in enumerate(plans.uniform_specs(4))]
        built = plans.build(backend, specs, seed=59)
        with Scheduler(slots=0) as sched:
            sched.run(built.plan)
            for device in backend.devices:
                compute = sched.stream(device)

                def fails(label: str = device.label) -> None:
                    raise DeviceError("lost", call="synchronize", device=label)

                monkeypatch.setattr(compute, "synchronize", fails)
            with caplog.at_level(logging.ERROR, logger="expertstream.scheduler"), pytest.raises(DeviceError) as err:
                sched.run(built.plan)
            assert err.value.device == backend.devices[0].label
            assert [r.getMessage() for r in caplog.records] == [
                f"while draining after an error: synchronize on {backend.devices[1].label}: lost"
            ]
            monkeypatch.undo()
        built.close()
