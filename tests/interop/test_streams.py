"""Streams and events made elsewhere: wrapped without being owned, refused where they cannot exist."""

from __future__ import annotations

import numpy as np
import pytest

from expertstream.backends.base import Device, Stream
from expertstream.backends.dlpack import DLDeviceType
from expertstream.errors import InvalidArgument


class CudaStreamProtocol:
    """A stand-in for another library's stream that speaks ``__cuda_stream__``."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


class TorchLikeStream:
    def __init__(self, handle: int) -> None:
        self.cuda_stream = handle


class TorchLikeEvent:
    def __init__(self, handle: int) -> None:
        self.cuda_event = handle


def _is_gpu(device: Device) -> bool:
    return device.dlpack_device[0] is not DLDeviceType.CPU


def test_wrapping_a_stream_shares_its_queue_and_close_leaves_it_alive(device: Device) -> None:
    stream = device.stream()
    for obj in (stream, stream.handle, np.int64(stream.handle)):
        wrapped = device.stream_from(obj)
        assert wrapped.handle == stream.handle and not wrapped.owned
        buf = device.alloc(32)
        wrapped.memset(buf, 0, 32, 9)
        wrapped.close()
        stream.memset(buf, 0, 16, 1)  # the stream itself still works
        stream.synchronize()
        assert buf.read().tolist() == [1] * 16 + [9] * 16
        buf.close()
    stream.close()


@pytest.mark.parametrize("kind", [CudaStreamProtocol, TorchLikeStream])
def test_foreign_stream_objects(device: Device, kind: type) -> None:
    stream = device.stream()
    foreign = kind(stream.handle)
    if not _is_gpu(device):
        with pytest.raises(InvalidArgument, match=kind.__qualname__) as caught:
            device.stream_from(foreign)
        assert caught.value.call == "Device.stream_from"
    else:
        wrapped = device.stream_from(foreign)
        assert wrapped.handle == stream.handle and not wrapped.owned
        wrapped.close()
        stream.synchronize()  # not destroyed by the wrapper's close
    stream.close()


def test_refusals_name_the_type(device: Device) -> None:
    for obj in (object(), 1.5, True, "stream"):
        with pytest.raises(InvalidArgument, match=f"cannot wrap {type(obj).__qualname__} as a stream"):
            device.stream_from(obj)
    with pytest.raises(InvalidArgument, match="returned" if _is_gpu(device) else "Bad"):
        device.stream_from(type("Bad", (), {"__cuda_stream__": lambda self: (3, 1)})())
    event = device.event()
    with pytest.raises(InvalidArgument, match="use it as it is"):
        device.event_from(event)
    event.close()


def test_cuda_stream_protocol_on_cuda_only(device: Device) -> None:
    stream = device.stream()
    if device.dlpack_device[0] is DLDeviceType.CUDA:
        assert stream.__cuda_stream__() == (0, stream.handle)
        assert device.stream_from(stream).handle == stream.handle
    else:
        assert not hasattr(stream, "__cuda_stream__")
    stream.close()


def test_wrapped_events_are_not_owned(device: Device) -> None:
    if not _is_gpu(device):
        for obj in (1234, TorchLikeEvent(1234)):
            with pytest.raises(InvalidArgument, match="event"):
                device.event_from(obj)
        return
    event = device.event()
    handle = event.handle  # type: ignore[attr-defined]
    with pytest.raises(InvalidArgument, match="no native event yet"):
        device.event_from(TorchLikeEvent(0))
    for obj in (handle, TorchLikeEvent(handle)):
        wrapped = device.event_from(obj)
        assert not wrapped.owned
        stream = device.stream()
        stream.record(wrapped)
        wrapped.synchronize()
        wrapped.close()
        stream.record(event)  # the event itself was not destroyed
        event.synchronize()
        stream.close()
    event.close()


def test_stream_from_handle_class_method_still_wraps(device: Device) -> None:
    stream = device.stream()
    wrapped = Stream.from_handle(device, stream.handle)
    assert not wrapped.owned
    wrapped.close()
    stream.close()
