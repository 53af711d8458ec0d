"""Prefetch slots and their events: kept across runs, freed when a later allocation fails, events reused."""

from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType as Q

import expertstream
from expertstream.backends.base import Backend, HostBuffer, HostMemory, Usage
from expertstream.errors import InvalidArgument, OutOfDeviceMemory
from expertstream.scheduler import Fallback, Scheduler
from expertstream.scheduler.source import HostRegion

from . import plans


def test_a_second_run_of_the_same_plan_allocates_nothing(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    device = backend.device(0)
    built = plans.build(backend, plans.uniform_specs(6), seed=41)
    with Scheduler(slots=3) as sched:
        sched.run(built.plan)
        prefetch = sched._prefetch[device]
        assert [slot.buffer.usage for slot in prefetch._slots] == [Usage.COMPUTE] * 3  # garbage until filled
        made: list[str] = []
        real_alloc, real_event = device.alloc, device.event
        monkeypatch.setattr(device, "alloc", lambda *a, **k: made.append("alloc") or real_alloc(*a, **k))
        # Timing events are reused once their wait is over, which on a GPU depends on its pace:
        # only the slots and their ready and free events are counted here.
        monkeypatch.setattr(device, "event", lambda timing=False: made.append(f"event {timing}") or real_event(timing))
        stats = sched.run(built.plan)
    built.check()
    assert stats.device(device.label).consumed == 6
    assert [m for m in made if m != "event True"] == [], "the slots and their events are reused"
    built.close()


def test_rows_that_need_no_padding_get_no_tail_clearing_in_a_slot(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    specs = [spec for spec in plans.uniform_specs(8) if spec.row_type is Q.F16]  # 96 F16 elements: no padding
    built = plans.build(backend, specs, seed=42)
    stream_type = type(backend.device(0).stream())
    real_memset = stream_type.memset
    sizes: list[int] = []

    def counting_memset(self, dst, offset, nbytes, value=0):  # type: ignore[no-untyped-def]
        sizes.append(nbytes)
        real_memset(self, dst, offset, nbytes, value)

    with Scheduler(slots=0) as sched:
        sched.run(built.plan)  # the scratch's one zeroing happens here
        sched.slots = 2
        monkeypatch.setattr(stream_type, "memset", counting_memset)
        stats = sched.run(built.plan)
    built.check()
    assert stats.device(backend.device(0).label).consumed == len(specs)
    assert sizes == []
    built.close()


@pytest.mark.parametrize("failing_event", [1, 2], ids=["ready", "free"])
def test_a_slot_whose_event_cannot_be_made_frees_what_it_had(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, failing_event: int
) -> None:
    device = backend.device(0)
    built = plans.build(backend, plans.uniform_specs(6), seed=43)
    with Scheduler(slots=3) as sched:
        sched.slots = 0
        sched.run(built.plan)
        sched.slots = 3
        buffers, events = [], {"n": 0}
        real_alloc, real_event = device.alloc, device.event

        def alloc(*args, **kwargs):  # type: ignore[no-untyped-def]
            buffers.append(real_alloc(*args, **kwargs))
            return buffers[-1]

        def event(timing: bool = False):  # type: ignore[no-untyped-def]
            if not timing:
                events["n"] += 1
                if events["n"] == 2 + failing_event:  # the first slot's two events, then the second slot's
                    raise OutOfDeviceMemory("no more events", call="event", device=device.label)
            return real_event(timing)

        monkeypatch.setattr(device, "alloc", alloc)
        monkeypatch.setattr(device, "event", event)
        stats = sched.run(built.plan)
        built.check()
        assert len(buffers) == 2 and buffers[1].closed, "the second slot's buffer is freed at once"
    dev = stats.device(device.label)
    assert dev.fallbacks[Fallback.ALLOC_FAILED] == 1 and dev.consumed == 1
    built.close()


def test_a_timing_pair_that_cannot_be_completed_frees_its_first_event(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    device = backend.device(0)
    built = plans.build(backend, plans.uniform_specs(4), seed=44)
    made = []
    real_event = device.event

    def every_second_timing_event_fails(timing: bool = False):  # type: ignore[no-untyped-def]
        if timing and len(made) % 2:
            made.append(None)
            raise OutOfDeviceMemory("no more events", call="event", device=device.label)
        event = real_event(timing)
        if timing:
            made.append(event)
        return event

    monkeypatch.setattr(device, "event", every_second_timing_event_fails)
    with Scheduler(slots=3) as sched:
        stats = sched.run(built.plan)
    built.check()
    assert stats.device(device.label).untimed_waits == 4
    assert made and all(event.closed for event in made if event is not None)
    built.close()


def test_ready_wait_time_adds_up_every_wait(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    device = backend.device(0)
    built = plans.build(backend, plans.uniform_specs(6, host=HostMemory.PAGEABLE), seed=45)
    event_type = type(device.event(timing=True))
    monkeypatch.setattr(event_type, "elapsed_ms", lambda self, end: 1.5)
    with Scheduler(slots=3) as sched:
        first = sched.run(built.plan).device(device.label)
        second = sched.run(built.plan).device(device.label)
    built.check()
    assert first.untimed_waits == 0 and first.ready_wait_ms == 6 * 1.5
    assert second.ready_wait_ms == 6 * 1.5, "each run counts its own waits"
    built.close()


@pytest.mark.parametrize(
    ("start", "length", "message"),
    [
        (-1, 10, r"host region \[-1, 9\) is outside"),
        (0, -1, r"host region \[0, -1\) is outside"),
        (60, 10, r"host region \[60, 70\) is outside"),
        (1, 64, r"host region \[1, 65\) is outside"),
    ],
)
def test_a_host_region_outside_its_buffer_is_refused(backend: Backend, start: int, length: int, message: str) -> None:
    host = backend.device(0).alloc_pinned(64)
    with pytest.raises(InvalidArgument, match=message):
        HostRegion(host, start, length)
    host.close()


def _region(backend: Backend) -> tuple[HostBuffer, HostRegion]:
    host = backend.device(0).alloc_pinned(64)
    return host, HostRegion(host, 16, 32)


@pytest.mark.parametrize(
    ("offset", "nbytes", "message"),
    [
        (-1, 4, r"range \[-1, 3\) is outside a 32-byte host region"),
        (0, -1, r"range \[0, -1\) is outside"),
        (30, 4, r"range \[30, 34\) is outside"),
        (20, 20, r"range \[20, 40\) is outside"),
    ],
)
def test_a_copy_outside_a_host_region_is_refused(backend: Backend, offset: int, nbytes: int, message: str) -> None:
    host, region = _region(backend)
    device = backend.device(0)
    stream, dst = device.stream(), device.alloc(64)
    with pytest.raises(InvalidArgument, match=message):
        region.enqueue_h2d(stream, dst, 0, offset, nbytes)
    for resource in (dst, stream, host):
        resource.close()


def test_empty_regions_and_copies_are_allowed(backend: Backend) -> None:
    host, region = _region(backend)
    assert HostRegion(host, 64, 0).nbytes == 0
    device = backend.device(0)
    stream, dst = device.stream(), device.alloc(64)
    region.enqueue_h2d(stream, dst, 0, 32, 0)
    region.enqueue_h2d(stream, dst, 0, 0, 32)  # the whole region, up to its last byte
    stream.synchronize()
    assert dst.read(0, 32).tolist() == host.array[16:48].tolist()
    for resource in (dst, stream, host):
        resource.close()


@pytest.mark.parametrize("compute_rate", [None, 1e6], ids=["compute-keeps-up", "compute-far-behind"])
def test_timing_events_are_reused_without_waiting_for_the_compute_stream(compute_rate: float | None) -> None:
    # Virtual time decides which waits are over, so this runs on the simulator only.
    profile = {"base": "cuda-h200"} if compute_rate is None else {"base": "cuda-h200", "flops_per_s": compute_rate}
    backend = expertstream.backend("sim", profile=profile, check_hazards=True)
    device = backend.device(0)
    built = plans.build(backend, plans.uniform_specs(12), seed=46)
    made: list[bool] = []
    real_event = device.event
    device.event = lambda timing=False: made.append(timing) or real_event(timing)  # type: ignore[method-assign]
    with Scheduler(slots=3) as sched:
        stats = sched.run(built.plan).device(device.label)
    built.check()
    assert stats.consumed == 12 and stats.untimed_waits == 0 and stats.ready_wait_ms >= 0
    if compute_rate is None:
        assert sum(made) <= 2 * 3, "a pair whose wait is over is used again"
    built.close()
    backend.close()
