"""Each hazard the simulator reports names the call, the device and what to do about it."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest

import expertstream
from expertstream.backends.base import Device, Usage
from expertstream.backends.sim import Access, HazardKind, KernelSpec, SimBackend, register_kernel
from expertstream.errors import HazardError

ORDERING = "record an event after the earlier operation and make the later one's stream wait for it"
UNWRITTEN = "write or clear those bytes first"
PADDING = "clear the padding with memset(buffer, offset, n, 0) after every copy into the buffer"


def _read_padded(args: tuple[Any, ...]) -> Sequence[Access]:
    src, padded_from = args
    return [Access(src, write=False, padded_from=int(padded_from))]


READ_PADDED = register_kernel(
    KernelSpec(
        "hazard_report_read_padded", run=lambda args, grid, block: None, accesses=_read_padded, flops=lambda args: 0.0
    )
)


@pytest.fixture
def sim() -> Iterator[SimBackend]:
    backend = expertstream.backend("sim", profile="cuda-h200", devices=1, check_hazards=True)
    assert isinstance(backend, SimBackend)
    yield backend
    backend.close()


def _read_after_write(dev: Device) -> None:
    s1, s2 = dev.stream(), dev.stream()
    buf, out = dev.alloc(256), dev.alloc(256)
    s1.memset(buf, 0, 256, 1)
    s2.copy_d2d(out, 0, buf, 0, 256)


def _write_after_read(dev: Device) -> None:
    s1, s2 = dev.stream(), dev.stream()
    buf, out = dev.alloc(256), dev.alloc(256)
    s1.memset(buf, 0, 256, 1)
    s1.synchronize()
    s1.copy_d2d(out, 0, buf, 0, 256)
    s2.memset(buf, 0, 256, 2)


def _write_after_write(dev: Device) -> None:
    s1, s2 = dev.stream(), dev.stream()
    buf = dev.alloc(256)
    s1.memset(buf, 0, 256, 1)
    s2.memset(buf, 0, 256, 2)


def _uninitialized_read(dev: Device) -> None:
    stream = dev.stream()
    scratch, out = dev.alloc(256, Usage.COMPUTE), dev.alloc(256)
    stream.copy_d2d(out, 0, scratch, 0, 256)


def _stale_padding(dev: Device, *, zeroed_first: bool) -> None:
    stream = dev.stream()
    slot = dev.alloc(256, Usage.COMPUTE)
    host = dev.alloc_pinned(256)
    host.array[:] = 7
    if zeroed_first:
        stream.memset(slot, 0, 256, 0)
    stream.copy_h2d(slot, 0, host, 0, 256 if zeroed_first else 200)
    stream.launch(dev.compile("", READ_PADDED.name), 1, 1, (slot.view(), np.int64(200)))


CASES: list[tuple[Callable[[Device], None], HazardKind, str, str, str]] = [
    (_read_after_write, HazardKind.READ_AFTER_WRITE, "Stream.copy_d2d", ORDERING, "last written by memset"),
    (_write_after_read, HazardKind.WRITE_AFTER_READ, "Stream.memset", ORDERING, "that d2d copy on stream"),
    (_write_after_write, HazardKind.WRITE_AFTER_WRITE, "Stream.memset", ORDERING, "also written by memset"),
    (_uninitialized_read, HazardKind.UNINITIALIZED_READ, "Stream.copy_d2d", UNWRITTEN, "which nothing has written"),
    (
        lambda dev: _stale_padding(dev, zeroed_first=False),
        HazardKind.STALE_PADDING,
        "Stream.launch(hazard_report_read_padded)",
        PADDING,
        "reads padding bytes [200, 256) of",
    ),
    (
        lambda dev: _stale_padding(dev, zeroed_first=True),
        HazardKind.STALE_PADDING,
        "Stream.launch(hazard_report_read_padded)",
        PADDING,
        "wrote after they were last zeroed",
    ),
]


@pytest.mark.parametrize(
    ("make", "kind", "call", "hint", "says"), CASES, ids=[c[1].value + str(i) for i, c in enumerate(CASES)]
)
def test_a_hazard_report_names_call_device_and_remedy(
    sim: SimBackend, make: Callable[[Device], None], kind: HazardKind, call: str, hint: str, says: str
) -> None:
    dev = sim.device(0)
    with pytest.raises(HazardError) as info:
        make(dev)
    err = info.value
    assert getattr(err, "kind", None) is kind
    assert (err.call, err.device, err.hint) == (call, dev.label, hint)
    assert str(err).startswith(f"{call} on {dev.label}: {kind.value}")
    assert str(err).endswith(f". {hint}")
    assert says in str(err)


def test_stale_padding_never_zeroed_says_so(sim: SimBackend) -> None:
    with pytest.raises(HazardError) as info:
        _stale_padding(sim.device(0), zeroed_first=False)
    assert "of DeviceBuffer" in str(info.value) and " that were never zeroed." in str(info.value)


def test_closing_a_buffer_still_in_use_names_call_device_and_remedy(sim: SimBackend) -> None:
    dev = sim.device(0)
    stream = dev.stream()
    buf = dev.alloc(256)
    stream.memset(buf, 0, 256, 1)
    with pytest.raises(HazardError) as info:
        buf.close()
    err = info.value
    assert getattr(err, "kind", None) is HazardKind.USE_AFTER_FREE
    assert (err.call, err.device) == ("DeviceBuffer.close", dev.label)
    assert err.hint == "synchronize the stream, or an event recorded after that work, before closing"
    stream.synchronize()
    buf.close()


def test_a_conflict_over_several_segments_of_one_writer_is_one_range(sim: SimBackend) -> None:
    dev = sim.device(0)
    s1, s2 = dev.stream(), dev.stream()
    buf, out = dev.alloc(300), dev.alloc(300)
    s1.memset(buf, 0, 300, 1)
    s1.copy_d2d(out, 0, buf, 100, 100)  # an ordered read splits the writer's bytes into three segments
    with pytest.raises(HazardError) as info:
        s2.copy_d2d(out, 0, buf, 0, 300)
    assert "bytes [0, 300) last written by memset" in str(info.value)


def test_bytes_outside_a_conflict_are_not_reported(sim: SimBackend) -> None:
    dev = sim.device(0)
    s1, s2 = dev.stream(), dev.stream()
    buf, out = dev.alloc(300), dev.alloc(300)
    s1.memset(buf, 0, 100, 1)
    s1.memset(buf, 200, 100, 2)
    s1.synchronize()
    s1.memset(buf, 0, 100, 3)  # unordered with s2 from here on
    s2.copy_d2d(out, 0, buf, 200, 100)  # disjoint from it: no hazard
    s2.copy_d2d(out, 100, buf, 100, 1)
    with pytest.raises(HazardError) as info:
        s2.copy_d2d(out, 0, buf, 0, 1)  # the first byte
    assert "bytes [0, 1)" in str(info.value)


def _two_views(args: tuple[Any, ...]) -> Sequence[Access]:
    first, second, write = args
    return [Access(first, write=bool(write)), Access(second, write=bool(write))]


TWO_VIEWS = register_kernel(
    KernelSpec("hazard_report_two_views", run=lambda args, grid, block: None, accesses=_two_views, flops=lambda a: 0.0)
)


@pytest.mark.parametrize("write", [False, True], ids=["reads", "writes"])
def test_an_empty_access_does_not_hide_the_next_one(sim: SimBackend, write: bool) -> None:
    dev = sim.device(0)
    s1, s2 = dev.stream(), dev.stream()
    buf, other = dev.alloc(256), dev.alloc(256)
    kernel = dev.compile("", TWO_VIEWS.name)
    if write:  # the kernel's write of buf must be recorded: a later unordered read conflicts with it
        s1.launch(kernel, 1, 1, (other.view(0, 0), buf.view(), np.int64(1)))
        with pytest.raises(HazardError, match="read-after-write"):
            s2.copy_d2d(other, 0, buf, 0, 256)
    else:  # the kernel's read of buf must be checked against the unordered memset
        s1.memset(buf, 0, 256, 1)
        with pytest.raises(HazardError, match="read-after-write"):
            s2.launch(kernel, 1, 1, (other.view(0, 0), buf.view(), np.int64(0)))


def test_a_read_marks_only_its_own_bytes(sim: SimBackend) -> None:
    dev = sim.device(0)
    s1, s2 = dev.stream(), dev.stream()
    buf, out = dev.alloc(300), dev.alloc(300)
    s1.memset(buf, 0, 300, 1)
    s1.synchronize()
    s1.copy_d2d(out, 0, buf, 200, 100)  # s1 reads [200, 300) only
    s2.memset(buf, 0, 100, 2)  # so a write of [0, 100) from another stream is no hazard
    with pytest.raises(HazardError, match=r"write-after-read hazard: .* bytes \[250, 300\)"):
        s2.memset(buf, 250, 50, 2)
    s2.synchronize()


def test_the_first_byte_of_a_fresh_compute_buffer_is_unwritten(sim: SimBackend) -> None:
    dev = sim.device(0)
    stream = dev.stream()
    scratch, out = dev.alloc(256, Usage.COMPUTE), dev.alloc(256)
    with pytest.raises(HazardError, match=r"uninitialized read: .* bytes \[0, 1\)"):
        stream.copy_d2d(out, 0, scratch, 0, 1)


def test_splitting_a_middle_segment_keeps_each_byte_with_its_writer(sim: SimBackend) -> None:
    dev = sim.device(0)
    s1, s2 = dev.stream(name="first"), dev.stream(name="second")
    buf, out = dev.alloc(300), dev.alloc(300)
    s1.memset(buf, 0, 100, 1)
    s1.copy_h2d(buf, 200, dev.alloc_pinned(100), 0, 100)
    s1.memset(buf, 150, 10, 3)  # splits the unwritten middle segment twice
    with pytest.raises(HazardError, match=r"bytes \[200, 300\) last written by h2d copy"):
        s2.copy_d2d(out, 0, buf, 200, 100)
    with pytest.raises(HazardError, match=r"bytes \[150, 160\) last written by memset"):
        s2.copy_d2d(out, 0, buf, 100, 100)


def test_an_empty_access_does_not_keep_a_buffer_in_use(sim: SimBackend) -> None:
    dev = sim.device(0)
    stream = dev.stream()
    untouched, other = dev.alloc(256), dev.alloc(256)
    stream.memset(other, 0, 256, 0)
    stream.launch(dev.compile("", TWO_VIEWS.name), 1, 1, (untouched.view(0, 0), other.view(), np.int64(1)))
    untouched.close()  # the kernel reads none of its bytes: nothing to wait for
    stream.synchronize()


def test_an_empty_view_inside_unwritten_compute_memory_reads_nothing(sim: SimBackend) -> None:
    dev = sim.device(0)
    stream = dev.stream()
    scratch, out = dev.alloc(256, Usage.COMPUTE), dev.alloc(256)
    stream.memset(out, 0, 256, 0)
    stream.launch(dev.compile("", TWO_VIEWS.name), 1, 1, (scratch.view(5, 0), out.view(), np.int64(0)))
    stream.synchronize()
