"""torch and CuPy objects on a real GPU: streams, events and tensors go both ways without copies."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from expertstream.backends.base import Device
from expertstream.backends.dlpack import DLDeviceType

from .reach import torch_reaching


def _torch_on(device: Device) -> Any:
    if device.dlpack_device[0] is DLDeviceType.CPU:
        pytest.skip("the simulator has no foreign streams, events or device tensors")
    return torch_reaching(device)


def test_torch_streams_and_events_wrap_without_ownership(device: Device) -> None:
    torch = _torch_on(device)
    torch_stream = torch.cuda.Stream(device=device.index)
    wrapped = device.stream_from(torch_stream)
    assert wrapped.handle == torch_stream.cuda_stream and not wrapped.owned
    buf = device.alloc(1 << 20)
    wrapped.memset(buf, 0, buf.nbytes, 5)
    torch_event = torch.cuda.Event()
    torch_event.record(torch_stream)
    event = device.event_from(torch_event)
    assert not event.owned
    event.synchronize()
    event.close()
    wrapped.close()
    torch_stream.synchronize()  # still alive after the wrapper closed
    torch_event.synchronize()
    assert buf.read(0, 16).tolist() == [5] * 16
    buf.close()


def test_torch_reads_a_producer_stream_write_on_its_own_stream(device: Device) -> None:
    torch = _torch_on(device)
    n = 64 << 20
    buf = device.alloc(n)
    producer = device.stream()
    producer.memset(buf, 0, n, 1)  # large enough to still run when torch enqueues its sum
    typed = buf.as_array(np.uint8, stream=producer)
    consumer = torch.cuda.Stream(device=device.index)
    with torch.cuda.stream(consumer):
        tensor = torch.from_dlpack(typed)  # torch passes `consumer`: it waits for `producer`
        total = int(tensor.sum(dtype=torch.int64))
    assert total == n
    assert tensor.data_ptr() == buf.address
    producer.close()
    buf.close()


def test_torch_tensor_views_of_an_offset_bf16_view(device: Device) -> None:
    torch = _torch_on(device)
    buf = device.alloc(4096)
    values = torch.arange(1024, dtype=torch.float32).to(torch.bfloat16)
    buf.write(values.view(torch.int16).numpy())
    tensor = torch.from_dlpack(buf.view(512).as_array(torch.bfloat16, (4, 64)))
    assert tensor.dtype == torch.bfloat16 and tensor.shape == (4, 64)
    assert torch.equal(tensor.cpu().view(-1), values[256:512])
    tensor.fill_(2.0)
    torch.cuda.synchronize()
    two = torch.tensor(2.0, dtype=torch.bfloat16).view(torch.int16).item()
    assert np.frombuffer(buf.read(512, 2), np.int16)[0] == two
    buf.close()


def test_torch_external_stream_and_cai_round_trip(device: Device) -> None:
    torch = _torch_on(device)
    if device.dlpack_device[0] is not DLDeviceType.CUDA:
        pytest.skip("the CUDA array interface and __cuda_stream__ are CUDA's")
    stream = device.stream()
    external = torch.cuda.ExternalStream(stream.handle, device=torch.device("cuda", device.index))
    assert device.stream_from(external).handle == stream.handle
    buf = device.alloc(256)
    buf.write(np.arange(64, dtype=np.float32))
    tensor = torch.as_tensor(buf.as_array(np.float32, (8, 8), stream=stream), device=f"cuda:{device.index}")
    assert tensor.data_ptr() == buf.address and tensor[1, 0].item() == 8.0
    stream.close()
    buf.close()


def test_cupy_streams_and_arrays(device: Device) -> None:
    if device.dlpack_device[0] is not DLDeviceType.CUDA:
        pytest.skip("CuPy is tested on CUDA")
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    with cupy.cuda.Device(device.index):
        cupy_stream = cupy.cuda.Stream(non_blocking=True)
        wrapped = device.stream_from(cupy_stream)
        assert wrapped.handle == cupy_stream.ptr
        buf = device.alloc(256)
        buf.write(np.arange(64, dtype=np.float32))
        with cupy_stream:
            array = cupy.from_dlpack(buf.as_array(np.float32, (64,), stream=wrapped))
            assert float(array.sum()) == float(np.arange(64).sum())
        same = cupy.asarray(buf.as_array(np.float32, (8, 8)))  # the CUDA array interface
        assert same.data.ptr == buf.address
        wrapped.close()
        cupy_stream.synchronize()
        buf.close()
