"""The scheduler on every usable backend: slots never change what the kernels read."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from expertstream.backends.base import Backend, HostMemory
from expertstream.errors import DeviceError, InvalidArgument, OutOfDeviceMemory
from expertstream.scheduler import Fallback, Scheduler

from . import plans


@pytest.mark.parametrize("slots", [1, 9, -1])
def test_bad_slot_counts_are_refused(slots: int) -> None:
    with pytest.raises(ValueError, match="slots"):
        Scheduler(slots=slots)


def test_slots_must_be_an_int() -> None:
    with pytest.raises(TypeError):
        Scheduler(slots=2.0)  # type: ignore[arg-type]


@pytest.mark.parametrize("host", [HostMemory.PINNED, HostMemory.PAGEABLE])
def test_outputs_identical_for_every_slot_count(backend: Backend, host: HostMemory) -> None:
    built = plans.build(backend, plans.uniform_specs(9, host=host), seed=1)
    try:
        results = {}
        for slots in (0, 2, 3, 4, 8):
            with Scheduler(slots=slots) as sched:
                stats = sched.run(built.plan)
            built.check()
            results[slots] = built.read_outputs()
            dev = stats.device(backend.device(0).label)
            if slots:
                assert dev.fires == dev.consumed == 9
                assert dev.bytes_stock == 0
            else:
                assert dev.fires == 0 and dev.stock_copies == 9
        for slots, outs in results.items():
            assert all(np.array_equal(a, b) for a, b in zip(outs, results[0], strict=True)), slots
    finally:
        built.close()


def test_slots_zero_allocates_nothing_for_prefetch(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    device = backend.device(0)
    built = plans.build(backend, plans.uniform_specs(4), seed=2)
    sizes: list[int] = []
    real_alloc = device.alloc
    monkeypatch.setattr(device, "alloc", lambda n, *a, **k: sizes.append(n) or real_alloc(n, *a, **k))
    with Scheduler(slots=0) as sched:
        sched.run(built.plan)
        assert not sched._prefetch
        # One scratch buffer for the one host input position, nothing else.
        assert sizes == [max(inp.padded_nbytes for s in built.plan.splits for inp in s.inputs)]
    built.check()
    built.close()


@pytest.mark.parametrize("host", [HostMemory.PINNED, HostMemory.REGISTERED, HostMemory.PAGEABLE])
@pytest.mark.parametrize("gather", [True, False])
def test_decode_scale_copies_only_used_experts(backend: Backend, gather: bool, host: HostMemory) -> None:
    built = plans.build(backend, plans.uniform_specs(4, prefill=False, host=host), seed=3)
    with Scheduler(slots=3, gather=gather) as sched:
        stats = sched.run(built.plan)
    dev = stats.device(backend.device(0).label)
    assert dev.fires == 0, "decode must keep the stock path"
    total = sum(inp.nbytes for s in built.plan.splits for inp in s.inputs)
    if gather and host is not HostMemory.PAGEABLE:
        # The device copies the used experts itself: no host sync to read the ids, no DMA.
        assert (dev.gathers, dev.ids_readbacks, dev.stock_copies) == (4, 0, 0)
        bound = sum(
            3 * min(inp.expert_nbytes + inp.padded_nbytes - inp.nbytes, inp.nbytes)  # 3 ids of 4 experts
            for s in built.plan.splits
            for inp in s.inputs
            if inp.expert_nbytes is not None
        )
        assert dev.bytes_gathered_at_most == bound
    else:
        assert (dev.gathers, dev.ids_readbacks) == (0, 4)
        assert 0 < dev.bytes_stock < total
    assert not dev.fallbacks
    built.check()
    built.close()


def test_a_device_that_cannot_gather_reads_ids_back_and_says_so_once(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    device = backend.device(0)
    built = plans.build(backend, plans.uniform_specs(4, prefill=False), seed=7)

    def unmapped(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        raise DeviceError("pinned host memory is not mapped for this device", call="gather", device=device.label)

    monkeypatch.setattr(type(device.stream()), "gather_h2d", unmapped)
    with Scheduler() as sched, caplog.at_level(logging.WARNING, logger="expertstream.scheduler"):
        first = sched.run(built.plan)
        built.check()
        again = sched.run(built.plan)
        built.check()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and device.label in warnings[0] and "not mapped" in warnings[0]
    dev = first.device(device.label)
    assert dev.fallbacks[Fallback.GATHER_FAILED] == 1 and (dev.gathers, dev.ids_readbacks) == (0, 4)
    dev = again.device(device.label)
    assert not dev.fallbacks and (dev.gathers, dev.ids_readbacks) == (0, 4)
    built.close()


def test_prefill_threshold_is_configurable(backend: Backend) -> None:
    built = plans.build(backend, plans.uniform_specs(3), seed=4)  # n_ids == 2 * n_expert
    with Scheduler(slots=3, prefill_factor=3) as sched:
        stats = sched.run(built.plan)
    assert stats.device(backend.device(0).label).fires == 0
    built.check()
    built.close()


def test_invalid_routing_ids_are_named(backend: Backend) -> None:
    built = plans.build(backend, plans.uniform_specs(1, prefill=False), seed=5)
    routing = built.plan.splits[0].mul_mat_id
    assert routing is not None
    routing.ids.buffer.write(np.full(routing.n_ids, 99, dtype=np.int32))
    with Scheduler() as sched, pytest.raises(ValueError, match=r"layer0.*routing id 99"):
        sched.run(built.plan)
    built.close()


def test_a_host_region_over_device_memory_is_refused(backend: Backend) -> None:
    from expertstream.scheduler import HostRegion

    with backend.device(0).alloc(64) as buf, pytest.raises(InvalidArgument, match=r"not of a .*DeviceBuffer"):
        HostRegion(buf, 0, 64)  # type: ignore[arg-type]


def test_an_expert_size_that_does_not_make_the_tensor_is_named(backend: Backend) -> None:
    from expertstream.scheduler import HostRegion, Input, MulMatId, Split

    device = backend.device(0)
    with device.upload(np.zeros(8, dtype=np.int32)) as ids:
        host = device.wrap_host(np.zeros(4096, dtype=np.uint8))
        weights = Input("up_exps", 4096, host=HostRegion(host, 0, 4096), expert_nbytes=512)  # 8 experts' worth
        with pytest.raises(InvalidArgument, match=r"split 'layer3'.*'up_exps'.*4096 bytes.*4 experts of 512"):
            Split("layer3", device, (weights,), lambda stream, bindings: None, MulMatId(ids.view(), 8, 4, ("up_exps",)))


def test_allocation_failure_falls_back_once(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    device = backend.device(0)
    built = plans.build(backend, plans.uniform_specs(6), seed=6)
    with Scheduler(slots=3) as sched:
        sched.slots = 0
        sched.run(built.plan)  # scratch exists now: every later allocation is a prefetch slot
        sched.slots = 3
        real_alloc = device.alloc
        calls = {"n": 0}

        def failing_alloc(n, *args, **kwargs):  # type: ignore[no-untyped-def]
            calls["n"] += 1
            if calls["n"] == 2:
                raise OutOfDeviceMemory(f"cannot allocate {n} bytes", call="alloc", device=device.label)
            return real_alloc(n, *args, **kwargs)

        monkeypatch.setattr(device, "alloc", failing_alloc)
        with caplog.at_level(logging.WARNING, logger="expertstream.scheduler"):
            stats = sched.run(built.plan)
            built.check()
            again = sched.run(built.plan)
            built.check()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and device.label in warnings[0].getMessage()
    assert "bytes free" in warnings[0].getMessage()
    dev = stats.device(device.label)
    assert dev.fallbacks[Fallback.ALLOC_FAILED] == 1
    assert dev.consumed == 1  # the one slot filled before the failure is still used
    assert dev.stock_copies == 5
    assert again.device(device.label).fallbacks[Fallback.DISABLED] == 6
    built.close()


def test_changing_slot_count_frees_what_is_unused(backend: Backend) -> None:
    device = backend.device(0)
    built = plans.build(backend, plans.uniform_specs(6), seed=7)
    with Scheduler(slots=4) as sched:
        sched.run(built.plan)
        prefetch = sched._prefetch[device]
        assert len(prefetch._slots) == 4
        dropped = [slot.buffer for slot in prefetch._slots[2:]]
        sched.slots = 2
        assert len(prefetch._slots) == 2
        assert all(buf.closed for buf in dropped)
        sched.run(built.plan)
        built.check()
        kept = [slot.buffer for slot in prefetch._slots]
        sched.slots = 0
        assert not sched._prefetch and all(buf.closed for buf in kept)
        sched.run(built.plan)
        built.check()
    built.close()


def test_a_failed_copy_on_the_worker_reaches_the_caller(backend: Backend) -> None:
    import dataclasses

    from expertstream.scheduler import Plan

    built = plans.build(backend, plans.uniform_specs(6, host=HostMemory.PAGEABLE), seed=8)
    counter = {"n": 0}
    splits = []
    for split in built.plan.splits:
        inp = split.inputs[0]
        failing = dataclasses.replace(inp, host=plans.FailingSource(inp.host, counter, fail_on=3))
        splits.append(dataclasses.replace(split, inputs=(failing,)))
    with Scheduler(slots=3) as sched:
        with pytest.raises(OSError, match="went away"):
            sched.run(Plan.of(splits))
        counter["n"] = -100  # the source works again: the scheduler must still be usable
        sched.run(Plan.of(splits))
    built.check()
    built.close()


def test_slots_zero_creates_no_stream_or_event(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    device = backend.device(0)
    built = plans.build(backend, plans.uniform_specs(3), seed=9)
    with Scheduler(slots=0) as sched:
        sched.stream(device)  # the compute stream exists before counting
        made: list[str] = []
        real_stream, real_event = device.stream, device.event
        monkeypatch.setattr(device, "stream", lambda *a, **k: made.append("stream") or real_stream(*a, **k))
        monkeypatch.setattr(device, "event", lambda *a, **k: made.append("event") or real_event(*a, **k))
        sched.run(built.plan)
    assert made == []
    built.check()
    built.close()
