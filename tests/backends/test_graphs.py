"""Stream capture and graphs: what a capture records runs again, on current data, with one launch."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import expertstream
from expertstream.backends.base import Backend, BackendError, Usage
from expertstream.backends.sim.profiles import CUDA_H200
from expertstream.engine import standin
from expertstream.errors import InvalidArgument, UseAfterClose
from expertstream.kernels import MoeKernels


def test_a_graph_runs_its_copies_gathers_and_kernels_again_on_current_data(backend: Backend) -> None:
    device = backend.device(0)
    n = 256
    rows = np.arange(4 * n, dtype=np.float32)  # four rows a gather picks from
    host = device.alloc_pinned(rows.nbytes)
    host.numpy(write=True)[:] = rows.view(np.uint8)
    ids_host = device.alloc_pinned(4)
    with (
        MoeKernels(device) as kernels,
        device.alloc(n * 4, Usage.COMPUTE) as h,
        device.alloc(rows.nbytes, Usage.COMPUTE) as picked,
        device.alloc(4, Usage.COMPUTE) as ids,
        device.stream() as stream,
    ):
        stream.memset(h, 0, h.alloc_size, 0)
        stream.memset(picked, 0, picked.alloc_size, 0)
        stream.memset(ids, 0, 4, 0)
        standin.add_inplace(kernels, stream, h.view(), picked.view(0, n * 4), n)  # compiled before the capture
        stream.synchronize()
        stream.begin_capture()
        stream.copy_h2d(ids, 0, ids_host, 0, 4)  # the id, read from page-locked memory as the graph runs
        stream.gather_h2d(picked, 0, host, 0, rows.nbytes, ids.view(), 1, n * 4)  # that row, to its own offset
        standin.add_inplace(kernels, stream, h.view(), picked.view(0, n * 4), n)  # h += row 0's place
        graph = stream.end_capture()
        assert graph is not None and graph.operations == 3
        ids_host.numpy(write=True)[:] = np.array([2], dtype=np.int32).view(np.uint8)
        graph.launch(stream)
        stream.synchronize()
        got = picked.read().view(np.float32)
        assert np.array_equal(got[2 * n : 3 * n], rows[2 * n : 3 * n]) and not got[:n].any()
        assert not h.read().any(), "row 0's place is still zero"
        ids_host.numpy(write=True)[:] = np.array([0], dtype=np.int32).view(np.uint8)
        for launches in (1, 2):
            graph.launch(stream)
            stream.synchronize()
            assert np.array_equal(h.read().view(np.float32), launches * rows[:n]), launches
        graph.close()
        with pytest.raises(UseAfterClose):
            graph.launch(stream)
    host.close()
    ids_host.close()


def test_a_capture_refuses_what_would_wait_for_the_host(backend: Backend) -> None:
    device = backend.device(0)
    pageable = device.wrap_host(np.zeros(64, dtype=np.uint8))
    with device.alloc(64) as dst, device.stream() as stream, device.event() as event:
        stream.begin_capture()
        with pytest.raises(InvalidArgument, match="capturing stream takes no copies with pageable host memory"):
            stream.copy_h2d(dst, 0, pageable, 0, 64)
        with pytest.raises(InvalidArgument, match="capturing stream takes no events"):
            stream.record(event)
        with pytest.raises(InvalidArgument, match="capturing already"):
            stream.begin_capture()
        with pytest.raises(BackendError):
            stream.synchronize()  # the runtime refuses it (and ends the capture there)
        with contextlib.suppress(BackendError):
            stream.end_capture(keep=False)
        assert not stream.capturing
        with pytest.raises(InvalidArgument, match="not capturing"):
            stream.end_capture()
        stream.copy_h2d(dst, 0, pageable, 0, 64)  # after the capture, as before it
        stream.synchronize()
    pageable.close()


def test_on_the_simulator_a_launch_costs_the_host_one_call_and_the_device_every_operation() -> None:
    profile = CUDA_H200
    nbytes, count = 1 << 20, 50
    with expertstream.backend("sim", profile=profile, data=False) as backend:
        device = backend.device(0)
        with device.alloc(nbytes) as buf, device.stream() as stream:
            stream.begin_capture()
            for _ in range(count):
                stream.memset(buf, 0, nbytes, 0)
            graph = stream.end_capture()
            assert graph is not None and graph.operations == count
            stream.synchronize()  # nothing was enqueued: the capture only cost the host its calls
            start = backend.host.timestamp()
            graph.launch(stream)
            issued = backend.host.timestamp()
            stream.synchronize()
            done = backend.host.timestamp()
    assert issued - start == pytest.approx(profile.enqueue_s)
    assert done - issued == pytest.approx(count * (profile.launch_latency_s + nbytes / profile.memset_bps), rel=1e-6)


def test_a_capture_refuses_an_allocation_on_its_device(backend: Backend) -> None:
    """As CUDA and HIP do in their default capture mode: what a captured plan needs is allocated first."""
    device = backend.device(0)
    with device.stream() as stream:
        stream.begin_capture()
        with pytest.raises(BackendError):
            device.alloc(64)
        with contextlib.suppress(BackendError):
            stream.end_capture(keep=False)
        assert not stream.capturing
    with device.alloc(64) as buf:  # after the capture, as before it
        assert buf.alloc_size >= 64


def test_a_stream_closed_while_capturing_leaves_its_device_allocating() -> None:
    with expertstream.backend("sim") as sim:
        device = sim.device(0)
        stream = device.stream()
        stream.begin_capture()
        with pytest.raises(BackendError):
            device.alloc(64)
        stream.close()  # error cleanup may close a capturing stream; its capture ends with it
        with device.alloc(64) as buf:
            assert buf.alloc_size >= 64
