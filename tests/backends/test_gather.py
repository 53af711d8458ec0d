"""Stream.gather_h2d: the rows that device-resident ids name, copied by the device from page-locked memory."""

from __future__ import annotations

import numpy as np
import pytest

from expertstream.backends.base import Backend, HostBuffer, HostMemory, Usage
from expertstream.errors import InvalidArgument

SENTINEL = 0xAB


def _host(backend: Backend, data: np.ndarray, kind: HostMemory) -> HostBuffer:
    device = backend.device(0)
    if kind is HostMemory.PINNED:
        host = device.alloc_pinned(data.nbytes)
        host.numpy(write=True)[:] = data
        return host
    host = device.wrap_host(data)
    host.register()
    return host


@pytest.mark.parametrize("kind", [HostMemory.PINNED, HostMemory.REGISTERED])
@pytest.mark.parametrize(
    ("row", "n_rows", "src_offset", "dst_offset", "overrun"),
    [
        (70_001, 5, 7, 9, 100),  # rows over three 32 KiB chunks; source and destination misaligned
        (65_584, 4, 16, 32, 48),  # 16-byte words with a head and a tail
        (96, 6, 0, 0, 200),  # the overrun reaches past the next row, and is cut at the region's end
    ],
)
def test_gather_copies_each_named_row_once_and_nothing_else(
    backend: Backend, kind: HostMemory, row: int, n_rows: int, src_offset: int, dst_offset: int, overrun: int
) -> None:
    device = backend.device(0)
    rng = np.random.default_rng(row)
    nbytes = row * n_rows
    data = rng.integers(0, 256, src_offset + nbytes + 5, dtype=np.uint8)
    ids = np.array([n_rows - 1, 1, -1, 1, n_rows, 3], dtype=np.int32)  # a repeat, and two ids naming no row
    host = _host(backend, data, kind)
    with (
        device.alloc(dst_offset + nbytes + 11, Usage.COMPUTE) as dst,
        device.upload(ids) as ids_buf,
        device.stream() as stream,
    ):
        stream.memset(dst, 0, dst.alloc_size, SENTINEL)
        stream.gather_h2d(dst, dst_offset, host, src_offset, nbytes, ids_buf.view(), ids.size, row, overrun)
        stream.synchronize()
        got = dst.read()
    expected = np.full(dst.alloc_size, SENTINEL, dtype=np.uint8)
    region = data[src_offset : src_offset + nbytes]
    for r in {n_rows - 1, 1, 3}:
        start, end = r * row, min((r + 1) * row + overrun, nbytes)
        expected[dst_offset + start : dst_offset + end] = region[start:end]
    assert np.array_equal(got, expected)
    host.close()


def test_gather_reads_the_ids_in_stream_order(backend: Backend) -> None:
    """Ids written on the stream just before (as a router's kernel writes them) are the ones gathered."""
    device = backend.device(0)
    row, n_rows = 4096, 4
    data = np.arange(row * n_rows, dtype=np.uint32).view(np.uint8)[: row * n_rows].copy()
    host = _host(backend, data, HostMemory.PINNED)
    staged = device.alloc_pinned(4)
    staged.numpy(write=True)[:] = np.array([2], dtype=np.int32).view(np.uint8)
    with (
        device.alloc(row * n_rows, Usage.COMPUTE) as dst,
        device.upload(np.array([0], dtype=np.int32)) as ids_buf,
        device.stream() as stream,
    ):
        stream.memset(dst, 0, dst.alloc_size, 0)
        stream.copy_h2d(ids_buf, 0, staged, 0, 4)  # the ids change on the stream, after upload's 0
        stream.gather_h2d(dst, 0, host, 0, row * n_rows, ids_buf.view(), 1, row)
        stream.synchronize()
        got = dst.read()
    assert np.array_equal(got[2 * row : 3 * row], data[2 * row : 3 * row])
    assert not got[: 2 * row].any() and not got[3 * row :].any()
    host.close()
    staged.close()


def test_gather_refuses_what_the_device_cannot_read_or_a_region_of_part_rows(backend: Backend) -> None:
    device = backend.device(0)
    data = np.zeros(1000, dtype=np.uint8)
    pageable = device.wrap_host(data)
    with device.alloc(1000) as dst, device.upload(np.zeros(2, dtype=np.int32)) as ids, device.stream() as stream:
        with pytest.raises(InvalidArgument, match="cannot read pageable host memory") as err:
            stream.gather_h2d(dst, 0, pageable, 0, 1000, ids.view(), 2, 100)
        assert "register the memory" in (err.value.hint or "")
        pageable.register()
        with pytest.raises(InvalidArgument, match="rows of 300 bytes do not divide the 1000-byte region"):
            stream.gather_h2d(dst, 0, pageable, 0, 1000, ids.view(), 2, 300)
        with pytest.raises(InvalidArgument, match="2 int32 ids need 8"):
            stream.gather_h2d(dst, 0, pageable, 0, 1000, ids.view(0, 4), 2, 100)
        with pytest.raises(InvalidArgument, match="starts at byte 2, not at an int32"):
            stream.gather_h2d(dst, 0, pageable, 0, 1000, ids.view(2, 4), 1, 100)
        with pytest.raises(InvalidArgument, match="outside"):
            stream.gather_h2d(dst, 1, pageable, 0, 1000, ids.view(), 2, 100)
    pageable.close()


def test_gather_skips_the_rows_its_skip_ids_name(backend: Backend) -> None:
    device = backend.device(0)
    row, n_rows = 4096, 6
    data = np.random.default_rng(3).integers(0, 256, row * n_rows, dtype=np.uint8)
    host = _host(backend, data, HostMemory.PINNED)
    ids = np.array([5, 0, 2, 4], dtype=np.int32)
    skip = np.array([2, 3, 5], dtype=np.int32)  # 3 is not among the ids: nothing to skip there
    with (
        device.alloc(data.nbytes, Usage.COMPUTE) as dst,
        device.upload(ids) as ids_buf,
        device.upload(skip) as skip_buf,
        device.stream() as stream,
    ):
        stream.memset(dst, 0, dst.alloc_size, SENTINEL)
        stream.gather_h2d(
            dst, 0, host, 0, data.nbytes, ids_buf.view(), ids.size, row, skip=skip_buf.view(), n_skip=skip.size
        )
        stream.synchronize()
        got = dst.read()
        with pytest.raises(InvalidArgument, match="no skip ids"):
            stream.gather_h2d(dst, 0, host, 0, data.nbytes, ids_buf.view(), ids.size, row, n_skip=2)
        with pytest.raises(InvalidArgument, match="at least 4 int32"):
            stream.gather_h2d(dst, 0, host, 0, data.nbytes, ids_buf.view(), 1, row, skip=skip_buf.view(), n_skip=4)
    expected = np.full(data.nbytes, SENTINEL, dtype=np.uint8)
    for r in (0, 4):
        expected[r * row : (r + 1) * row] = data[r * row : (r + 1) * row]
    assert np.array_equal(got, expected)
    host.close()


@pytest.mark.parametrize(("row", "src_offset", "dst_offset"), [(70_001, 7, 9), (4096, 0, 0)])
def test_a_packed_gather_puts_rows_one_after_another_and_says_where(
    backend: Backend, row: int, src_offset: int, dst_offset: int
) -> None:
    """A decode step's lookahead: the predicted rows packed first, then the chosen ones after them,
    each chosen id's slot written for the kernels; a predicted one's slot is where it already lies."""
    device = backend.device(0)
    n_rows, overrun = 6, 100  # packed rows take no overrun: the row after them is another's
    data = np.random.default_rng(row).integers(0, 256, src_offset + row * n_rows, dtype=np.uint8)
    region = data[src_offset:]
    host = _host(backend, data, HostMemory.PINNED)
    predicted = np.array([3, 0], dtype=np.int32)
    ids = np.array([4, 1, -1, 1, 3, 2], dtype=np.int32)  # a repeat, an id naming no row, a predicted one
    packed_rows = predicted.size + ids.size
    with (
        device.alloc(dst_offset + packed_rows * row + 11, Usage.COMPUTE) as dst,
        device.upload(ids) as ids_buf,
        device.upload(predicted) as predicted_buf,
        device.upload(np.full(ids.size + 1, -7, dtype=np.int32)) as slots,
        device.upload(np.full(2, -1, dtype=np.int32)) as report,
        device.stream() as stream,
    ):
        stream.memset(dst, 0, dst.alloc_size, SENTINEL)
        whole = (host, src_offset, row * n_rows)
        stream.gather_h2d(dst, dst_offset, *whole, predicted_buf.view(), predicted.size, row, overrun, packed=True)
        stream.gather_h2d(
            dst,
            dst_offset,
            *whole,
            ids_buf.view(),
            ids.size,
            row,
            overrun,
            report=report.view(),
            tag=5,
            skip=predicted_buf.view(),
            n_skip=predicted.size,
            packed=True,
            slots=slots.view(),
        )
        stream.synchronize()
        got, got_slots, got_report = dst.read(), slots.read().view(np.int32), report.read().view(np.int32)
    expected = np.full(dst.alloc_size, SENTINEL, dtype=np.uint8)
    # predicted 3, 0 at rows 0, 1; then the row of the id first met at j at row 2 + j
    for at, source in ((0, 3), (1, 0), (2, 4), (3, 1), (7, 2)):
        expected[dst_offset + at * row : dst_offset + (at + 1) * row] = region[source * row : (source + 1) * row]
    for at in (4, 5, 6):  # nothing goes to the rows of j = 2, 3, 4: what is read past the row before is zeroed
        expected[dst_offset + at * row : dst_offset + at * row + overrun] = 0
    assert np.array_equal(got, expected)
    assert got_slots.tolist() == [2, 3, 0, 3, 0, 7, -7]  # the id naming no row: slot 0, and reported
    assert got_report.tolist() == [5, -1]
    host.close()


def test_a_packed_gather_refuses_slots_it_cannot_write_or_rows_past_its_destination(backend: Backend) -> None:
    device = backend.device(0)
    row = 100
    host = _host(backend, np.zeros(10 * row, dtype=np.uint8), HostMemory.PINNED)
    with (
        device.alloc(3 * row) as dst,
        device.upload(np.zeros(3, dtype=np.int32)) as ids,
        device.stream() as stream,
    ):
        whole = (host, 0, 10 * row, ids.view(), 3, row)
        stream.gather_h2d(dst, 0, *whole, packed=True, slots=ids.view())  # three rows fit three packed ids
        with pytest.raises(InvalidArgument, match="outside"):
            stream.gather_h2d(dst, 1, *whole, packed=True)
        with pytest.raises(InvalidArgument, match="outside"):
            stream.gather_h2d(dst, 0, host, 0, 10 * row, ids.view(), 2, row, packed=True, skip=ids.view(), n_skip=2)
        with pytest.raises(InvalidArgument, match="packed gathers only"):
            stream.gather_h2d(dst, 0, *whole, slots=ids.view())
        with pytest.raises(InvalidArgument, match="3 int32 slots need 12"):
            stream.gather_h2d(dst, 0, *whole, packed=True, slots=ids.view(0, 8))
        with pytest.raises(InvalidArgument, match="packed must be a bool"):
            stream.gather_h2d(dst, 0, *whole, packed=1)  # type: ignore[arg-type]
        stream.synchronize()
    host.close()
