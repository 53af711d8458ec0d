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
