"""The backend contract, checked the same way on every backend (copies, memsets and events only)."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from expertstream.backends.base import Device, HostBuffer, HostMemory, Stream, Usage
from expertstream.errors import DeviceError, InvalidArgument, OutOfDeviceMemory, UseAfterClose
from expertstream.ggml import row_size

Q4_0 = GGMLQuantizationType.Q4_0
F16 = GGMLQuantizationType.F16


def _bytes(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _pinned(device: Device, data: np.ndarray) -> HostBuffer:
    host = device.alloc_pinned(data.nbytes)
    host.numpy(write=True)[:] = data
    return host


def test_host_views_for_reading_and_writing_page_locked_memory(device: Device) -> None:
    data = _bytes(4096, seed=11)
    stream = device.stream()
    with device.alloc_pinned(4096) as host, device.alloc(4096) as buf:
        host.numpy(write=True)[:] = data
        stream.copy_h2d(buf, 0, host, 0, 4096)
        stream.synchronize()
        host.numpy(1024, 16, write=True)[:] = 0
        stream.copy_d2h(host, 0, buf, 0, 2048)
        stream.synchronize()
        view = host.numpy(1000, 100)
        assert np.array_equal(view, data[1000:1100]) and not view.flags.writeable
        with pytest.raises(InvalidArgument, match="outside"):
            host.numpy(4000, 100)
    stream.close()


@pytest.mark.parametrize(("n", "dst_offset", "src_offset"), [(1, 0, 0), (3, 1, 7), (4095, 129, 3), (65537, 7, 1)])
def test_h2d_d2h_round_trip_odd_sizes_and_offsets(device: Device, n: int, dst_offset: int, src_offset: int) -> None:
    data = _bytes(n + src_offset, seed=n)
    stream = device.stream()
    with device.alloc(dst_offset + n + 5) as buf:
        stream.copy_h2d(buf, dst_offset, device.wrap_host(data), src_offset, n)
        out = np.zeros(n + 3, dtype=np.uint8)
        stream.copy_d2h(device.wrap_host(out), 2, buf, dst_offset, n)
        stream.synchronize()
        assert np.array_equal(out[2 : 2 + n], data[src_offset:])
        assert not out[:2].any() and not out[2 + n :].any()  # nothing outside the range was written
    stream.close()


@pytest.mark.parametrize(("n", "dst_offset", "src_offset"), [(1, 0, 5), (777, 3, 11), (4097, 13, 1)])
def test_d2d_round_trip_odd_sizes_and_offsets(device: Device, n: int, dst_offset: int, src_offset: int) -> None:
    data = _bytes(src_offset + n, seed=n + 1)
    stream = device.stream()
    with device.upload(data) as src, device.alloc(dst_offset + n) as dst:
        stream.copy_d2d(dst, dst_offset, src, src_offset, n)
        stream.synchronize()
        assert np.array_equal(dst.read(dst_offset, n), data[src_offset:])
    stream.close()


def test_memset_odd_range_leaves_neighbours(device: Device) -> None:
    data = _bytes(1000, seed=3)
    stream = device.stream()
    with device.upload(data) as buf:
        stream.memset(buf, 13, 101, 0xAB)
        stream.synchronize()
        expected = data.copy()
        expected[13:114] = 0xAB
        assert np.array_equal(buf.read(), expected)
    stream.close()


def test_stream_runs_work_in_fifo_order(device: Device) -> None:
    first, second = _bytes(4096, seed=4), _bytes(1000, seed=5)
    stream = device.stream()
    host_first, host_second = _pinned(device, first), _pinned(device, second)
    out = device.alloc_pinned(4096)
    with device.alloc(4096) as buf, device.alloc(4096) as copy:
        stream.copy_h2d(buf, 0, host_first, 0, 4096)
        stream.memset(buf, 100, 500, 0x11)
        stream.copy_h2d(buf, 300, host_second, 0, 1000)
        stream.copy_d2d(copy, 0, buf, 0, 4096)
        stream.memset(buf, 0, 4096, 0)  # after the d2d: must not show in ``copy``
        stream.copy_d2h(out, 0, copy, 0, 4096)
        stream.synchronize()
        expected = first.copy()
        expected[100:600] = 0x11
        expected[300:1300] = second
        assert np.array_equal(out.array, expected)
    for host in (host_first, host_second, out):
        host.close()
    stream.close()


def test_event_wait_orders_work_across_streams(device: Device) -> None:
    data = _bytes(1 << 20, seed=6)
    producer, consumer = device.stream(), device.stream()
    host, out = _pinned(device, data), device.alloc_pinned(data.nbytes)
    ready = device.event()
    with device.alloc(data.nbytes) as buf, device.alloc(data.nbytes) as copy:
        producer.copy_h2d(buf, 0, host, 0, data.nbytes)
        producer.record(ready)
        consumer.wait(ready)
        consumer.copy_d2d(copy, 0, buf, 0, data.nbytes)
        consumer.copy_d2h(out, 0, copy, 0, data.nbytes)
        consumer.synchronize()
        assert np.array_equal(out.array, data)
        producer.synchronize()
    host.close()
    out.close()


def test_wait_on_never_recorded_event_is_a_no_op(device: Device) -> None:
    stream, never = device.stream(), device.event()
    assert never.query()
    never.synchronize()  # returns at once
    with device.alloc(64) as buf:
        stream.wait(never)
        stream.memset(buf, 0, 64, 0x5A)
        stream.synchronize()
        assert np.array_equal(buf.read(), np.full(64, 0x5A, dtype=np.uint8))


def test_rerecording_an_event_rearms_it(device: Device) -> None:
    s1, s2, s3 = device.stream(), device.stream(), device.stream()
    event = device.event()
    with device.alloc(256) as a, device.alloc(256) as b, device.alloc(256) as out_a, device.alloc(256) as out_b:
        s1.memset(a, 0, 256, 1)
        s1.record(event)
        s2.wait(event)  # bound to the first record
        s2.copy_d2d(out_a, 0, a, 0, 256)
        s1.memset(b, 0, 256, 2)
        s1.record(event)  # re-armed: later waits see the second record
        s3.wait(event)
        s3.copy_d2d(out_b, 0, b, 0, 256)
        device.synchronize()
        assert np.array_equal(out_a.read(), np.full(256, 1, dtype=np.uint8))
        assert np.array_equal(out_b.read(), np.full(256, 2, dtype=np.uint8))


def test_query_and_synchronize(device: Device) -> None:
    s1, s2 = device.stream(), device.stream()
    assert s1.query()  # nothing enqueued
    done = device.event()
    with device.alloc(1 << 20) as a, device.alloc(1 << 20) as b:
        s1.memset(a, 0, a.nbytes, 3)
        s1.record(done)
        s2.memset(b, 0, b.nbytes, 4)
        done.synchronize()
        assert done.query()
        device.synchronize()
        assert s1.query() and s2.query()
        assert a.read(0, 16).tolist() == [3] * 16 and b.read(0, 16).tolist() == [4] * 16


def test_pinned_pageable_and_registered_host_memory(device: Device) -> None:
    data = _bytes(8192, seed=7)
    pinned = _pinned(device, data)
    assert pinned.kind is HostMemory.PINNED and pinned.is_page_locked
    pageable = device.wrap_host(data.copy())
    assert pageable.kind is HostMemory.PAGEABLE and not pageable.is_page_locked
    stream = device.stream()
    with device.alloc(3 * 8192) as buf:
        stream.copy_h2d(buf, 0, pinned, 0, 8192)
        stream.copy_h2d(buf, 8192, pageable, 0, 8192)
        to_register = device.wrap_host(data.copy())
        if device.capabilities.host_register:
            to_register.register()
            assert to_register.kind is HostMemory.REGISTERED and to_register.is_page_locked
        else:
            with pytest.raises(DeviceError, match="registration"):
                to_register.register()
        stream.copy_h2d(buf, 2 * 8192, to_register, 0, 8192)
        stream.synchronize()
        assert np.array_equal(buf.read(), np.concatenate([data, data, data]))
        to_register.close()
    pinned.close()


def test_read_only_file_mapping(device: Device, tmp_path: Path) -> None:
    data = _bytes(65536, seed=8)
    path = tmp_path / "weights.bin"
    path.write_bytes(data.tobytes())
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    host = device.wrap_host(mapping)
    assert host.read_only and host.kind is HostMemory.PAGEABLE
    stream = device.stream()
    with device.alloc(data.nbytes) as buf:
        stream.copy_h2d(buf, 0, host, 0, data.nbytes)
        stream.synchronize()
        assert np.array_equal(buf.read(), data)
        with pytest.raises(InvalidArgument, match="read-only"):
            stream.copy_d2h(host, 0, buf, 0, 16)
        with pytest.raises(InvalidArgument, match="read-only"):
            host.register(read_only=False)
        if device.capabilities.host_register_read_only:
            host.register()
            assert host.kind is HostMemory.REGISTERED
            stream.memset(buf, 0, buf.nbytes, 0)
            stream.copy_h2d(buf, 0, host, 0, data.nbytes)
            stream.synchronize()
            assert np.array_equal(buf.read(), data)
            host.unregister()
            assert host.kind is HostMemory.PAGEABLE
        else:
            with pytest.raises(DeviceError, match="read-only"):
                host.register()
    host.close()


def test_padded_alloc_size(device: Device) -> None:
    q_rows = row_size(Q4_0, 768) * 4
    assert device.alloc_size(q_rows, Q4_0, 768) == q_rows + row_size(Q4_0, 256)
    assert device.alloc_size(768 * 2 * 4, F16, 768) == 768 * 2 * 4  # not quantized: no padding
    assert device.alloc_size(row_size(Q4_0, 1024) * 4, Q4_0, 1024) == row_size(Q4_0, 1024) * 4  # ne0 % 512 == 0
    with device.alloc(q_rows, Usage.COMPUTE, row_type=Q4_0, ne0=768) as buf:
        assert (buf.nbytes, buf.alloc_size, buf.usage) == (q_rows, q_rows + row_size(Q4_0, 256), Usage.COMPUTE)


@pytest.mark.parametrize("usage", [Usage.WEIGHTS, Usage.ANY])
def test_padding_zeroed_at_alloc(device: Device, usage: Usage) -> None:
    q_rows = row_size(Q4_0, 768) * 4
    with device.alloc(q_rows, usage, row_type=Q4_0, ne0=768) as buf:
        pad = buf.alloc_size - buf.nbytes
        assert pad == row_size(Q4_0, 256)
        assert not buf.read(buf.nbytes, pad).any()


def test_closed_objects_raise_use_after_close(device: Device) -> None:
    host = device.wrap_host(np.zeros(64, dtype=np.uint8))
    stream = device.stream()
    buf = device.alloc(64)
    buf.close()
    with pytest.raises(UseAfterClose):
        stream.copy_h2d(buf, 0, host, 0, 64)
    with pytest.raises(UseAfterClose):
        stream.memset(buf, 0, 64, 0)
    with pytest.raises(UseAfterClose):
        buf.read()
    event = device.event()
    event.close()
    with pytest.raises(UseAfterClose):
        stream.record(event)
    stream.close()
    with device.alloc(64) as live, pytest.raises(UseAfterClose):
        stream.memset(live, 0, 64, 0)


def test_bad_arguments_name_the_range(device: Device) -> None:
    host = device.wrap_host(np.zeros(256, dtype=np.uint8))
    stream = device.stream()
    with device.alloc(100) as buf:
        with pytest.raises(InvalidArgument, match=r"\[10, 110\)"):
            stream.copy_h2d(buf, 10, host, 0, 100)
        with pytest.raises(InvalidArgument, match=r"\[-1, 9\)"):
            stream.memset(buf, -1, 10, 0)
        with pytest.raises(InvalidArgument, match=r"\[200, 300\)"):
            stream.copy_d2h(host, 200, buf, 0, 100)
        with pytest.raises(InvalidArgument, match="not a byte"):
            stream.memset(buf, 0, 10, 256)
        with pytest.raises(InvalidArgument):
            stream.copy_h2d(host, 0, host, 0, 10)  # type: ignore[arg-type]


def test_out_of_memory_names_bytes_asked_and_free(device: Device) -> None:
    asked = device.total_memory + 1
    with pytest.raises(OutOfDeviceMemory) as info:
        device.alloc(asked)
    assert str(asked) in str(info.value) and "free" in str(info.value)


def test_timing_events_and_elapsed_time(device: Device) -> None:
    stream = device.stream()
    start, end = device.event(timing=True), device.event(timing=True)
    with device.alloc(1 << 22) as buf:
        stream.record(start)
        stream.memset(buf, 0, buf.nbytes, 1)
        stream.record(end)
        end.synchronize()
        ms = start.elapsed_ms(end)
        assert isinstance(ms, float) and ms >= 0.0
        assert end.elapsed_ms(start) == pytest.approx(-ms, abs=1e-3)
    plain = device.event()
    stream.record(plain)
    stream.synchronize()
    with pytest.raises(InvalidArgument, match="timing"):
        start.elapsed_ms(plain)


def test_stream_from_handle_shares_the_queue(device: Device) -> None:
    stream = device.stream()
    wrapped = Stream.from_handle(device, stream.handle)
    assert wrapped.handle == stream.handle
    with device.alloc(128) as buf:
        stream.memset(buf, 0, 128, 7)
        wrapped.memset(buf, 0, 64, 9)  # same queue: runs after the first memset
        wrapped.synchronize()
        assert buf.read().tolist() == [9] * 64 + [7] * 64
        wrapped.close()  # a wrapper leaves the stream alone
        stream.memset(buf, 0, 128, 1)
        stream.synchronize()
        assert buf.read().tolist() == [1] * 128
    stream.close()
