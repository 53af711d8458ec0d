"""Typed views of device memory as other libraries see them: DLPack, the CUDA array interface."""

from __future__ import annotations

import ctypes
import gc

import numpy as np
import pytest

from expertstream.backends.base import Device
from expertstream.backends.dlpack import DLDeviceType, live_exports
from expertstream.errors import InvalidArgument, UseAfterClose


def _host_memory(device: Device) -> None:
    if device.dlpack_device[0] is not DLDeviceType.CPU:
        pytest.skip(f"{device.label} memory is not host memory: numpy cannot read it")


def test_dlpack_device_names_the_memory(device: Device) -> None:
    buf = device.alloc(64)
    expected = {"cuda": DLDeviceType.CUDA, "hip": DLDeviceType.ROCM, "sim": DLDeviceType.CPU}[device.backend.name]
    assert buf.__dlpack_device__() == (expected, device.index if expected is not DLDeviceType.CPU else 0)
    assert buf.view(8).as_array(np.float32, (2, 2)).__dlpack_device__() == buf.__dlpack_device__()
    buf.close()


@pytest.mark.parametrize(
    ("offset", "nbytes", "dtype", "shape", "words"),
    [
        (0, 96, np.float32, (4, 8), "needs 128 bytes; the view holds 96"),
        (2, 8, np.float32, (2,), "4-byte alignment"),
        (0, 8, np.dtype("U4"), (2,), "not an element type"),
        (0, 8, object, (2,), "not an element type"),
        (0, 8, np.float32, (2, -1), "non-negative ints"),
        (0, 12, np.float64, None, "whole number of float64"),
    ],
)
def test_as_array_refuses_what_cannot_work(
    device: Device, offset: int, nbytes: int, dtype: object, shape: object, words: str
) -> None:
    buf = device.alloc(100)
    with pytest.raises(InvalidArgument, match=words) as caught:
        buf.view(offset, nbytes).as_array(dtype, shape)  # type: ignore[arg-type]
    assert caught.value.call == "BufferView.as_array"
    buf.close()


def test_as_array_refuses_a_stream_of_another_device_and_a_closed_buffer(device: Device) -> None:
    buf = device.alloc(64)
    with pytest.raises(InvalidArgument, match="producer stream"):
        buf.as_array(np.uint8, stream="not a stream")  # type: ignore[arg-type]
    buf.close()
    with pytest.raises(UseAfterClose):
        buf.as_array(np.uint8)


def test_dtypes_by_name_torch_spelling_and_bfloat16(device: Device) -> None:
    buf = device.alloc(64)
    assert buf.as_array("torch.float16", (4,)).dtype.name == "float16"  # str(torch.float16)
    bf16 = buf.as_array("bfloat16", (2, 16))
    assert (bf16.dtype.name, bf16.dtype.bits, bf16.shape, bf16.nbytes) == ("bfloat16", 16, (2, 16), 64)
    assert buf.as_array(np.int32).shape == (16,)  # no shape: every whole element
    buf.close()


def test_cuda_array_interface_v3_with_the_producer_stream(device: Device) -> None:
    buf = device.alloc(256)
    if device.dlpack_device[0] is not DLDeviceType.CUDA:
        assert not hasattr(buf, "__cuda_array_interface__")
        assert not hasattr(buf.as_array(np.float32, (4,)), "__cuda_array_interface__")
        return
    stream = device.stream()
    iface = buf.view(64).as_array(np.float32, (4, 8), stream=stream).__cuda_array_interface__
    assert iface == {
        "version": 3,
        "shape": (4, 8),
        "typestr": "<f4",
        "data": (buf.address + 64, False),
        "strides": None,
        "stream": stream.handle,
    }
    raw = buf.__cuda_array_interface__
    assert (raw["shape"], raw["typestr"], raw["stream"]) == ((256,), "|u1", None)
    assert not hasattr(buf.as_array("bfloat16"), "__cuda_array_interface__")  # no typestr: DLPack only
    stream.close()
    buf.close()


def test_numpy_reads_and_writes_through_dlpack(device: Device) -> None:
    _host_memory(device)
    buf = device.alloc(256)
    buf.write(np.arange(64, dtype=np.float32))
    array = np.from_dlpack(buf.view(32).as_array(np.float32, (4, 8)))  # offset view: elements 8..39
    assert (array.dtype, array.shape) == (np.float32, (4, 8))
    assert np.array_equal(array, np.arange(8, 40, dtype=np.float32).reshape(4, 8))
    array[1, 2] = -1.0  # element 8 + 10
    assert np.frombuffer(buf.read(), np.float32)[18] == -1.0
    buf.write(np.float32(7.5).tobytes(), offset=32)
    assert array[0, 0] == 7.5
    raw = np.from_dlpack(buf)
    assert (raw.dtype, raw.shape) == (np.uint8, (256,))
    buf.close()


def test_dlpack_waits_for_the_producer_stream_before_the_host_reads(device: Device) -> None:
    _host_memory(device)
    buf = device.alloc(64)
    stream = device.stream()
    stream.memset(buf, 0, 64, 3)  # enqueued, not yet observed by the host
    array = np.from_dlpack(buf.as_array(np.uint8, stream=stream))
    assert array.tolist() == [3] * 64
    stream.close()
    buf.close()


def test_an_exported_tensor_keeps_its_buffer_until_the_consumer_frees_it(device: Device) -> None:
    _host_memory(device)
    before = live_exports()
    buf = device.alloc(64)
    array = np.from_dlpack(buf.as_array(np.int32, (16,)))
    del buf
    gc.collect()
    assert live_exports() == before + 1
    array[:] = 5  # the memory is still the buffer's, which is still alive
    assert array.sum() == 80
    del array
    gc.collect()
    assert live_exports() == before


def test_an_unconsumed_capsule_frees_its_tensor(device: Device) -> None:
    is_valid = ctypes.PyDLL(None, handle=ctypes.pythonapi._handle).PyCapsule_IsValid
    is_valid.restype, is_valid.argtypes = ctypes.c_int, [ctypes.py_object, ctypes.c_char_p]
    buf = device.alloc(64)
    before = live_exports()
    for max_version in (None, (1, 0)):
        capsule = buf.as_array(np.float32).__dlpack__(max_version=max_version)
        name = b"dltensor" if max_version is None else b"dltensor_versioned"
        assert is_valid(capsule, name) == 1
        assert live_exports() == before + 1
        del capsule
        gc.collect()
        assert live_exports() == before
    buf.close()


def test_dlpack_refuses_a_copy_and_another_device(device: Device) -> None:
    buf = device.alloc(64)
    with pytest.raises(BufferError):
        buf.__dlpack__(copy=True)
    with pytest.raises(BufferError):
        buf.__dlpack__(dl_device=(99, 0))
    buf.close()
