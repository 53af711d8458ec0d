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
        stream.record(event)  # outside the capture
        stream.begin_capture()
        with pytest.raises(InvalidArgument, match="capturing stream takes no copies with pageable host memory"):
            stream.copy_h2d(dst, 0, pageable, 0, 64)
        with pytest.raises(InvalidArgument, match="waits only on events recorded in its own capture"):
            stream.wait(event)
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


def _fork_join_capture(device, kernels, origin, side, fork, join, a, b, c, n):  # type: ignore[no-untyped-def]
    """origin: a += a; fork; side: b += a; join; origin: c += b (each launch: what the order allows only)."""
    origin.begin_capture()
    standin.add_inplace(kernels, origin, a.view(), a.view(), n)
    origin.record(fork)
    side.wait(fork)  # side joins the capture
    assert side.capturing and side.capture_origin is origin
    standin.add_inplace(kernels, side, b.view(), a.view(), n)
    side.record(join)
    origin.wait(join)
    standin.add_inplace(kernels, origin, c.view(), b.view(), n)
    return origin.end_capture()


def test_a_forked_stream_joins_the_capture_and_its_graph_keeps_the_order(backend: Backend) -> None:
    device = backend.device(0)
    n = 64
    ones = np.ones(n, dtype=np.float32)
    with (
        MoeKernels(device) as kernels,
        device.upload(ones) as a,
        device.upload(np.zeros(n, np.float32)) as b,
        device.upload(np.zeros(n, np.float32)) as c,
        device.stream() as origin,
        device.stream() as side,
        device.event() as fork,
        device.event() as join,
    ):
        standin.add_inplace(kernels, origin, c.view(), c.view(), n)  # compiled before the capture
        origin.synchronize()
        graph = _fork_join_capture(device, kernels, origin, side, fork, join, a, b, c, n)
        assert graph is not None and graph.operations == 3
        assert not side.capturing and side.capture_origin is None
        for _ in range(3):  # a doubles; b gains the new a; c gains the new b
            graph.launch(origin)
            origin.synchronize()
        a_now, b_now, c_now = (buf.read().view(np.float32) for buf in (a, b, c))
        assert np.array_equal(a_now, 8 * ones)
        assert np.array_equal(b_now, (2 + 4 + 8) * ones)
        assert np.array_equal(c_now, (2 + 6 + 14) * ones)
        with pytest.raises(InvalidArgument, match="capture that has ended"):
            side.wait(fork)  # recorded inside a capture that is over
        graph.close()


def test_a_capture_whose_fork_never_joins_is_refused(backend: Backend) -> None:
    device = backend.device(0)
    with (
        MoeKernels(device) as kernels,
        device.upload(np.ones(16, np.float32)) as a,
        device.stream() as origin,
        device.stream() as side,
        device.event() as fork,
    ):
        standin.add_inplace(kernels, origin, a.view(), a.view(), 16)
        origin.synchronize()
        origin.begin_capture()
        origin.record(fork)
        side.wait(fork)
        standin.add_inplace(kernels, side, a.view(), a.view(), 16)  # never joined back
        with pytest.raises(InvalidArgument, match="joined another stream's capture"):
            side.end_capture()
        with pytest.raises(BackendError):
            origin.end_capture()
        assert not origin.capturing and not side.capturing


def test_on_the_simulator_a_graph_runs_its_forked_work_beside_the_launching_stream() -> None:
    """The forked copy in overlaps the origin's copy out when launched, as on a device."""
    with expertstream.backend("sim", profile=CUDA_H200, data=False) as backend:
        device = backend.device(0)
        nbytes = 64 << 20
        host = device.alloc_pinned(nbytes)
        out = device.alloc_pinned(nbytes)
        with (
            device.alloc(nbytes) as dst,
            device.alloc(nbytes) as other,
            device.stream() as origin,
            device.stream() as side,
            device.event() as fork,
            device.event() as join,
        ):
            origin.begin_capture()
            origin.record(fork)
            side.wait(fork)
            side.copy_h2d(dst, 0, host, 0, nbytes)  # on the link
            side.record(join)
            origin.copy_d2h(out, 0, other, 0, nbytes)  # beside it, the other way
            origin.wait(join)
            graph = origin.end_capture()
            assert graph is not None
            start = backend.host.timestamp()
            graph.launch(origin)
            origin.synchronize()
            took = backend.host.timestamp() - start
            copy_in, copy_out = nbytes / CUDA_H200.h2d_pinned_bps, nbytes / CUDA_H200.d2h_bps
            assert max(copy_in, copy_out) <= took < 1.1 * max(copy_in, copy_out) < 0.9 * (copy_in + copy_out)
            graph.close()
        host.close()
        out.close()
