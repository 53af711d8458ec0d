"""The simulator's hazard checker: every kind caught on a hand-built faulty schedule, and the fix passes."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest

import expertstream
from expertstream.backends.base import BufferView, DeviceBuffer, HostBuffer, Kernel, Stream, Usage
from expertstream.backends.sim import Access, HazardKind, KernelSpec, SimBackend, register_kernel
from expertstream.errors import HazardError, InvalidArgument, UseAfterClose

NO_PADDING = np.int64(-1)


def _copy_twin(args: tuple[Any, ...], grid: tuple[int, int, int], block: tuple[int, int, int]) -> None:
    src, dst, _padded_from = args
    dst[:] = src[: dst.size]


def _copy_accesses(args: tuple[Any, ...]) -> Sequence[Access]:
    src, dst, padded_from = args
    return [
        Access(src, write=False, padded_from=None if padded_from < 0 else int(padded_from)),
        Access(dst, write=True),
    ]


# A kernel that copies its first view into its second; the third argument is where the
# first view's padding starts (-1: no padding).
COPY_KERNEL = register_kernel(
    KernelSpec("hazard_test_copy", run=_copy_twin, accesses=_copy_accesses, flops=lambda args: 1e6)
)


def _peek_twin(args: tuple[Any, ...], grid: tuple[int, int, int], block: tuple[int, int, int]) -> None:
    """Declares a read of a view it is not given as an argument (checks Access-only buffers)."""


PEEK_VIEWS: dict[str, BufferView] = {}
PEEK_KERNEL = register_kernel(
    KernelSpec(
        "hazard_test_peek",
        run=_peek_twin,
        accesses=lambda args: [Access(PEEK_VIEWS["view"], write=False)],
        flops=lambda args: 0.0,
    )
)


@pytest.fixture
def sim() -> Iterator[SimBackend]:
    backend = expertstream.backend("sim", profile="cuda-h200", devices=2, peer_access=False, check_hazards=True)
    assert isinstance(backend, SimBackend)
    yield backend
    backend.close()


def _kernel(stream: Stream) -> Kernel:
    return stream.device.compile("", COPY_KERNEL.name)


def _launch_copy(stream: Stream, src: BufferView, dst: BufferView, padded_from: int | None = None) -> None:
    pad = NO_PADDING if padded_from is None else np.int64(padded_from)
    stream.launch(_kernel(stream), 1, 1, (src, dst, pad))


def _assert_report(err: HazardError, kind: HazardKind, buf: DeviceBuffer, lo: int, hi: int) -> None:
    text = str(err)
    assert getattr(err, "kind", None) is kind
    assert kind.value in text
    assert repr(buf) in text
    assert f"[{lo}, {hi})" in text


def _data(n: int) -> np.ndarray:
    return np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)


# -- read-after-write -------------------------------------------------------------------------


def test_read_after_write_without_wait(sim: SimBackend) -> None:
    dev = sim.device(0)
    copy, compute = dev.stream(name="copy"), dev.stream(name="compute")
    host = dev.alloc_pinned(4096)
    slot, out = dev.alloc(4096, Usage.COMPUTE), dev.alloc(4096, Usage.COMPUTE)
    copy.copy_h2d(slot, 0, host, 0, 4096)
    with pytest.raises(HazardError) as info:
        _launch_copy(compute, slot.view(), out.view())
    _assert_report(info.value, HazardKind.READ_AFTER_WRITE, slot, 0, 4096)
    assert "no event wait orders the h2d copy on stream" in str(info.value)
    assert "kernel 'hazard_test_copy'" in str(info.value)


def test_read_after_write_reports_only_the_unordered_bytes(sim: SimBackend) -> None:
    dev = sim.device(0)
    s1, s2 = dev.stream(), dev.stream()
    buf, out = dev.alloc(300), dev.alloc(300)
    s1.memset(buf, 0, 300, 1)
    s1.synchronize()  # the host has seen the first write: later work is ordered after it
    s1.memset(buf, 100, 100, 2)  # not waited for by s2
    with pytest.raises(HazardError) as info:
        s2.copy_d2d(out, 0, buf, 0, 300)
    _assert_report(info.value, HazardKind.READ_AFTER_WRITE, buf, 100, 200)
    assert "memset on stream" in str(info.value)


def test_read_after_write_ordered_by_event_passes(sim: SimBackend) -> None:
    dev = sim.device(0)
    copy, compute = dev.stream(), dev.stream()
    data = _data(4096)
    host = dev.alloc_pinned(4096)
    host.array[:] = data
    slot, out = dev.alloc(4096, Usage.COMPUTE), dev.alloc(4096, Usage.COMPUTE)
    ready = dev.event()
    copy.copy_h2d(slot, 0, host, 0, 4096)
    copy.record(ready)
    compute.wait(ready)
    _launch_copy(compute, slot.view(), out.view())
    compute.synchronize()
    assert np.array_equal(out.read(), data)


def test_uninitialized_compute_read(sim: SimBackend) -> None:
    dev = sim.device(0)
    stream = dev.stream()
    scratch, out = dev.alloc(512, Usage.COMPUTE), dev.alloc(512, Usage.COMPUTE)
    stream.memset(scratch, 0, 256, 0)
    with pytest.raises(HazardError) as info:
        _launch_copy(stream, scratch.view(), out.view())
    _assert_report(info.value, HazardKind.UNINITIALIZED_READ, scratch, 256, 512)
    with pytest.raises(HazardError, match="uninitialized read"):
        stream.copy_d2h(dev.alloc_pinned(512), 0, scratch, 0, 512)
    stream.memset(scratch, 256, 256, 0)
    _launch_copy(stream, scratch.view(), out.view())  # fully written now
    stream.synchronize()
    assert not out.read().any()


def test_never_written_weights_are_not_uninitialized(sim: SimBackend) -> None:
    dev = sim.device(0)
    stream = dev.stream()
    weights, out = dev.alloc(64, Usage.WEIGHTS), dev.alloc(64, Usage.COMPUTE)
    _launch_copy(stream, weights.view(), out.view())  # only COMPUTE memory is checked for this
    stream.synchronize()


# -- write-after-read and write-after-write ----------------------------------------------------


def _read_slot_on(sim: SimBackend) -> tuple[Stream, Stream, DeviceBuffer, DeviceBuffer]:
    dev = sim.device(0)
    copy, compute = dev.stream(name="copy"), dev.stream(name="compute")
    slot, out = dev.alloc(2048, Usage.COMPUTE), dev.alloc(2048, Usage.COMPUTE)
    copy.memset(slot, 0, 2048, 7)
    copy.synchronize()
    _launch_copy(compute, slot.view(), out.view())
    return copy, compute, slot, out


def test_write_after_read_slot_reused_too_early(sim: SimBackend) -> None:
    copy, _compute, slot, _out = _read_slot_on(sim)
    host = sim.device(0).alloc_pinned(1024)
    with pytest.raises(HazardError) as info:
        copy.copy_h2d(slot, 512, host, 0, 1024)  # the kernel may still be reading the slot
    _assert_report(info.value, HazardKind.WRITE_AFTER_READ, slot, 512, 1536)
    assert "no event wait orders the kernel 'hazard_test_copy' on stream" in str(info.value)


def test_write_after_read_ordered_by_free_event_passes(sim: SimBackend) -> None:
    copy, compute, slot, out = _read_slot_on(sim)
    free = sim.device(0).event()
    compute.record(free)
    copy.wait(free)
    copy.memset(slot, 0, 2048, 9)
    sim.device(0).synchronize()
    assert out.read().tolist() == [7] * 2048  # the kernel read the slot before it was overwritten
    assert slot.read().tolist() == [9] * 2048


def test_write_after_write_unordered(sim: SimBackend) -> None:
    dev = sim.device(0)
    s1, s2 = dev.stream(), dev.stream()
    buf = dev.alloc(1000)
    s1.memset(buf, 0, 600, 1)
    with pytest.raises(HazardError) as info:
        s2.memset(buf, 400, 600, 2)
    _assert_report(info.value, HazardKind.WRITE_AFTER_WRITE, buf, 400, 600)
    done = dev.event()
    s1.record(done)
    s2.wait(done)
    s2.memset(buf, 400, 600, 2)
    s2.synchronize()
    assert buf.read().tolist() == [1] * 400 + [2] * 600


def test_host_timestamp_hands_ordering_to_another_thread(sim: SimBackend) -> None:
    import threading

    dev = sim.device(0)
    s1, s2 = dev.stream(), dev.stream()
    buf = dev.alloc(64)
    s1.memset(buf, 0, 64, 1)
    s1.synchronize()
    stamp = sim.host.timestamp()
    errors: list[BaseException] = []

    def worker(resume: bool) -> None:
        try:
            if resume:
                sim.host.resume_at(stamp)
            s2.memset(buf, 0, 64, 2)
        except BaseException as exc:
            errors.append(exc)

    for resume in (False, True):
        thread = threading.Thread(target=worker, args=(resume,))
        thread.start()
        thread.join()
    # Without the handoff the worker knows nothing of the memset on s1; with it, it does.
    assert len(errors) == 1 and "write-after-write" in str(errors[0])


# -- use-after-free ---------------------------------------------------------------------------


def test_closed_buffers_raise_use_after_close(sim: SimBackend) -> None:
    dev = sim.device(0)
    stream = dev.stream()
    src, dst = dev.alloc(64), dev.alloc(64, Usage.COMPUTE)
    src.close()
    with pytest.raises(UseAfterClose):
        stream.launch(_kernel(stream), 1, 1, (src, dst, NO_PADDING))
    live = dev.alloc(64)
    PEEK_VIEWS["view"] = live.view()
    live.close()
    with pytest.raises(UseAfterClose):
        stream.launch(dev.compile("", PEEK_KERNEL.name), 1, 1, ())


def test_closing_a_buffer_in_use(sim: SimBackend) -> None:
    dev = sim.device(0)
    stream = dev.stream()
    src, dst = dev.alloc(4096), dev.alloc(4096, Usage.COMPUTE)
    _launch_copy(stream, src.view(), dst.view())
    with pytest.raises(HazardError) as info:
        src.close()
    assert "use-after-free" in str(info.value) and repr(src) in str(info.value)
    assert "kernel 'hazard_test_copy'" in str(info.value)
    assert not src.closed
    free_before = dev.free_memory()
    stream.synchronize()
    src.close()  # ordered now
    assert src.closed and dev.free_memory() == free_before + 4096


def test_closing_pinned_host_memory_with_a_pending_copy(sim: SimBackend) -> None:
    dev = sim.device(0)
    stream = dev.stream()
    host = dev.alloc_pinned(1 << 20)
    buf = dev.alloc(1 << 20)
    stream.copy_h2d(buf, 0, host, 0, 1 << 20)
    with pytest.raises(HazardError, match="use-after-free"):
        host.close()
    done = dev.event()
    stream.record(done)
    done.synchronize()
    host.close()
    assert host.closed


# -- cross-device -----------------------------------------------------------------------------


def test_cross_device_kernel_argument(sim: SimBackend) -> None:
    dev0, dev1 = sim.devices
    stream = dev0.stream()
    mine, theirs = dev0.alloc(64, Usage.COMPUTE), dev1.alloc(64)
    with pytest.raises(HazardError, match="cross-device"):
        _launch_copy(stream, theirs.view(), mine.view())
    PEEK_VIEWS["view"] = theirs.view(8, 16)
    with pytest.raises(HazardError) as info:
        stream.launch(dev0.compile("", PEEK_KERNEL.name), 1, 1, ())
    _assert_report(info.value, HazardKind.CROSS_DEVICE, theirs, 8, 24)


def test_cross_device_copy_without_peer_access(sim: SimBackend) -> None:
    dev0, dev1 = sim.devices
    with pytest.raises(InvalidArgument, match="peer access"):
        dev0.stream().copy_d2d(dev0.alloc(64), 0, dev1.alloc(64), 0, 64)
    with pytest.raises(expertstream.DeviceError, match="peer_access=True"):
        dev0.enable_peer_access(dev1)


def test_cross_device_with_peer_access_passes() -> None:
    with expertstream.backend("sim", devices=2, peer_access=True) as sim:
        dev0, dev1 = sim.devices
        dev0.enable_peer_access(dev1)
        assert dev0.can_access_peer(dev1) and not dev1.can_access_peer(dev0)
        data = _data(256)
        theirs, mine, copied = dev1.upload(data), dev0.alloc(256, Usage.COMPUTE), dev0.alloc(256)
        stream = dev0.stream()
        _launch_copy(stream, theirs.view(), mine.view())
        stream.copy_d2d(copied, 0, theirs, 0, 256)
        stream.synchronize()
        assert np.array_equal(mine.read(), data) and np.array_equal(copied.read(), data)


# -- stale padding ----------------------------------------------------------------------------


def _slot_with_tensor(sim: SimBackend, nbytes: int, padded: int, clear_tail: bool) -> tuple[Stream, DeviceBuffer]:
    dev = sim.device(0)
    stream = dev.stream()
    slot = dev.alloc(1024, Usage.COMPUTE)
    host = dev.alloc_pinned(1024)
    host.array[:] = 0x77
    stream.copy_h2d(slot, 0, host, 0, 1024)  # a larger tensor held the slot before
    stream.copy_h2d(slot, 0, host, 0, nbytes)
    if clear_tail:
        stream.memset(slot, nbytes, padded - nbytes, 0)
    return stream, slot


def test_stale_padding_after_slot_rotation(sim: SimBackend) -> None:
    stream, slot = _slot_with_tensor(sim, 600, 700, clear_tail=False)
    out = sim.device(0).alloc(700, Usage.COMPUTE)
    with pytest.raises(HazardError) as info:
        _launch_copy(stream, slot.view(0, 700), out.view(), padded_from=600)
    _assert_report(info.value, HazardKind.STALE_PADDING, slot, 600, 700)
    assert "h2d copy" in str(info.value)


def test_stale_padding_never_zeroed(sim: SimBackend) -> None:
    dev = sim.device(0)
    stream = dev.stream()
    slot, out = dev.alloc(700, Usage.COMPUTE), dev.alloc(700, Usage.COMPUTE)
    stream.copy_h2d(slot, 0, dev.alloc_pinned(600), 0, 600)
    with pytest.raises(HazardError, match=r"never zeroed") as info:
        _launch_copy(stream, slot.view(), out.view(), padded_from=600)
    _assert_report(info.value, HazardKind.STALE_PADDING, slot, 600, 700)


def test_cleared_padding_passes(sim: SimBackend) -> None:
    stream, slot = _slot_with_tensor(sim, 600, 700, clear_tail=True)
    out = sim.device(0).alloc(700, Usage.COMPUTE)
    _launch_copy(stream, slot.view(0, 700), out.view(), padded_from=600)
    stream.synchronize()
    assert out.read().tolist() == [0x77] * 600 + [0] * 100


def test_weights_padding_zeroed_at_alloc_passes(sim: SimBackend) -> None:
    from gguf import GGMLQuantizationType

    dev = sim.device(0)
    stream = dev.stream()
    weights = dev.alloc(432, Usage.WEIGHTS, row_type=GGMLQuantizationType.Q4_0, ne0=768)
    out = dev.alloc(weights.alloc_size, Usage.COMPUTE)
    _launch_copy(stream, weights.view(), out.view(), padded_from=weights.nbytes)
    stream.synchronize()
    assert not out.read(weights.nbytes).any()


def test_many_ordered_operations_pass(sim: SimBackend) -> None:
    """A long correct pipeline (2000 copies, kernels and events over 3 rotating slots) raises nothing."""
    dev = sim.device(0)
    copy, compute = dev.stream(), dev.stream()
    host = dev.alloc_pinned(3 * 256)
    host.array[:] = np.repeat(np.arange(3, dtype=np.uint8), 256)
    slots = [dev.alloc(256, Usage.COMPUTE) for _ in range(3)]
    ready, free = [dev.event() for _ in slots], [dev.event() for _ in slots]
    out = dev.alloc(256 * 500, Usage.COMPUTE)
    for i in range(500):
        k = i % 3
        copy.wait(free[k])
        copy.copy_h2d(slots[k], 0, host, 256 * k, 256)
        copy.record(ready[k])
        compute.wait(ready[k])
        _launch_copy(compute, slots[k].view(), out.view(256 * i, 256))
        compute.record(free[k])
    compute.synchronize()
    assert np.array_equal(out.read().reshape(500, 256)[:, 0], np.arange(500) % 3)


def test_unregistering_host_memory_with_a_pending_copy(sim: SimBackend) -> None:
    dev = sim.device(0)
    stream = dev.stream()
    host = dev.wrap_host(np.zeros(4096, dtype=np.uint8))
    host.register()
    buf = dev.alloc(4096)
    stream.copy_h2d(buf, 0, host, 0, 4096)
    with pytest.raises(HazardError, match="use-after-free"):
        host.unregister()
    stream.synchronize()
    host.unregister()


def test_pageable_host_memory_may_be_freed_once_the_copy_returns(sim: SimBackend) -> None:
    dev = sim.device(0)
    stream = dev.stream()
    host = dev.wrap_host(np.zeros(4096, dtype=np.uint8))
    stream.copy_h2d(dev.alloc(4096), 0, host, 0, 4096)
    host.close()  # the runtime staged the pageable bytes before the call returned


def test_empty_padded_range_is_not_stale_padding(sim: SimBackend) -> None:
    dev = sim.device(0)
    stream = dev.stream()
    slot, out = dev.alloc(1024, Usage.COMPUTE), dev.alloc(1024, Usage.COMPUTE)
    host = dev.alloc_pinned(1024)
    stream.copy_h2d(slot, 0, host, 0, 1024)  # the bytes at and after 600 were written by a copy
    _launch_copy(stream, slot.view(0, 600), out.view(0, 600), padded_from=600)  # nothing padded to read
    with pytest.raises(HazardError, match="stale padding"):
        _launch_copy(stream, slot.view(0, 601), out.view(0, 601), padded_from=600)


# -- peer access belongs to device objects ----------------------------------------------------


def test_peer_access_does_not_reach_another_backends_device_of_that_index() -> None:
    with (
        expertstream.backend("sim", devices=2, peer_access=True) as mine,
        expertstream.backend("sim", devices=2, peer_access=True) as theirs,
    ):
        dev0, dev1 = mine.devices
        dev1.enable_peer_access(dev0)
        foreign = theirs.device(0)
        assert dev1.can_access_peer(dev0) and not dev1.can_access_peer(foreign)
        assert dev1.capabilities.peer_access == {0}
        stream = dev1.stream()
        out = dev1.alloc(64, Usage.COMPUTE)
        _launch_copy(stream, dev0.upload(_data(64)).view(), out.view())  # a peer of this backend: allowed
        their_buf = foreign.upload(_data(64))
        with pytest.raises(HazardError, match="cross-device"):
            _launch_copy(stream, their_buf.view(), out.view())
        with pytest.raises(InvalidArgument, match="no peer access"):
            stream.copy_d2d(out, 0, their_buf, 0, 64)
        with pytest.raises(InvalidArgument, match="not a device of this backend"):
            dev1.enable_peer_access(foreign)
        stream.synchronize()


def test_host_memory_of_another_simulator_is_refused() -> None:
    """Its checker would never see this one's DMAs: a refill through it would pass unreported."""
    with (
        expertstream.backend("sim", devices=2) as mine,
        expertstream.backend("sim") as theirs,
    ):
        dev0, dev1 = mine.devices
        foreign = theirs.device(0)
        their_pinned = foreign.alloc_pinned(4096)
        their_pinned.numpy(write=True)[:] = 1
        their_pageable = foreign.wrap_host(np.zeros(4096, dtype=np.uint8))
        stream = dev0.stream()
        out = dev0.alloc(4096)
        refused = (
            lambda: stream.copy_h2d(out, 0, their_pinned, 0, 4096),
            lambda: stream.copy_h2d(out, 0, their_pageable, 0, 4096),
            lambda: stream.copy_d2h(their_pinned, 0, out, 0, 4096),
            lambda: stream.gather_h2d(out, 0, their_pinned, 0, 4096, dev0.upload(np.zeros(1, np.int32)).view(), 1, 64),
            lambda: mine.host.copy(their_pinned, 0, dev0.wrap_host(np.zeros(4096, dtype=np.uint8)), 0, 4096),
        )
        for copy in refused:
            with pytest.raises(InvalidArgument) as info:
                copy()
            assert f"is host memory of backend {theirs.instance_name}" in info.value.detail
            assert f"used by sim:0 of backend {mine.instance_name}" in info.value.detail or (
                f"used by backend {mine.instance_name}" in info.value.detail
            )
        theirs.host.copy(their_pinned, 0, their_pageable, 0, 4096)  # nothing of ours reads it
        # Another device of the same simulator shares its checker: its pinned memory is fine here.
        stream.copy_h2d(out, 0, dev1.alloc_pinned(4096), 0, 4096)
        stream.synchronize()


# -- host side: page-locked memory the device still reads or writes ---------------------------


@pytest.fixture(params=["pinned", "registered"])
def locked(request: pytest.FixtureRequest, sim: SimBackend) -> Iterator[HostBuffer]:
    dev = sim.device(0)
    if request.param == "pinned":
        host = dev.alloc_pinned(4096)
    else:
        host = dev.wrap_host(np.zeros(4096, dtype=np.uint8))
        host.register()
    yield host
    sim.device(0).synchronize()
    host.close()


def test_host_write_into_a_buffer_a_copy_still_reads(sim: SimBackend, locked: HostBuffer) -> None:
    dev = sim.device(0)
    stream = dev.stream(name="copy")
    locked.numpy(write=True)[:] = 1
    stream.copy_h2d(dev.alloc(4096), 0, locked, 1024, 2048)
    with pytest.raises(HazardError) as info:
        locked.numpy(2048, 1024, write=True)  # overlaps the bytes the DMA reads
    assert info.value.kind is HazardKind.WRITE_AFTER_READ  # type: ignore[attr-defined]
    text = str(info.value)
    assert "host write (numpy view) on host thread 0" in text and "h2d copy on stream" in text
    assert f"{locked!r} bytes [2048, 3072)" in text and "synchronize" in text
    with pytest.raises(HazardError, match="write-after-read"):
        sim.host.copy(locked, 0, dev.wrap_host(np.zeros(4096, dtype=np.uint8)), 0, 4096)
    locked.numpy(0, 1024, write=True)[:] = 2  # bytes the copy does not read
    assert locked.numpy(1024, 2048).tolist() == [1] * 2048  # reading what a copy reads is fine
    stream.synchronize()
    locked.numpy(write=True)[:] = 3  # ordered now


def test_host_read_of_a_buffer_a_copy_still_writes(sim: SimBackend, locked: HostBuffer) -> None:
    dev = sim.device(0)
    stream = dev.stream()
    data = _data(4096)
    src = dev.upload(data)
    done = dev.event()
    stream.copy_d2h(locked, 0, src, 0, 4096)
    stream.record(done)
    with pytest.raises(HazardError) as info:
        locked.numpy()
    assert info.value.kind is HazardKind.READ_AFTER_WRITE  # type: ignore[attr-defined]
    assert "d2h copy" in str(info.value)
    with pytest.raises(HazardError, match="read-after-write"):
        sim.host.copy(dev.wrap_host(np.zeros(16, dtype=np.uint8)), 0, locked, 0, 16)
    done.synchronize()
    assert np.array_equal(locked.numpy(), data)


def test_host_write_on_one_thread_then_a_copy_from_another(sim: SimBackend) -> None:
    import threading

    dev = sim.device(0)
    host = dev.alloc_pinned(256)
    stamps = {}

    def fill() -> None:
        host.numpy(write=True)[:] = 7
        stamps["filled"] = sim.host.timestamp()

    thread = threading.Thread(target=fill)
    thread.start()
    thread.join()
    stream, slot = dev.stream(), dev.alloc(256)
    with pytest.raises(HazardError, match=r"read-after-write.*host write") as info:
        stream.copy_h2d(slot, 0, host, 0, 256)  # nothing told this thread the fill is done
    assert "host.resume_at" in str(info.value)
    sim.host.resume_at(stamps["filled"])
    stream.copy_h2d(slot, 0, host, 0, 256)
    stream.synchronize()
    assert slot.read().tolist() == [7] * 256


def test_pageable_memory_is_the_hosts_again_once_the_call_returns(sim: SimBackend) -> None:
    dev = sim.device(0)
    stream = dev.stream()
    host = dev.wrap_host(np.zeros(4096, dtype=np.uint8))
    stream.copy_h2d(dev.alloc(4096), 0, host, 0, 4096)
    host.numpy(write=True)[:] = 1  # the runtime staged the bytes (or the call waited)


def test_read_views_are_read_only(sim: SimBackend) -> None:
    host = sim.device(0).alloc_pinned(64)
    with pytest.raises(ValueError, match="read-only"):
        host.numpy()[:] = 1
    with pytest.raises(InvalidArgument, match="read-only host memory"):
        sim.device(0).wrap_host(b"abc").numpy(write=True)
    with pytest.raises(InvalidArgument, match="outside"):
        host.numpy(60, 8)
