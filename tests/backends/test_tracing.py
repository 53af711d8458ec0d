"""Timelines: the event tracer brackets each operation; start_trace turns it on for real GPUs."""

from __future__ import annotations

import itertools

import numpy as np

from expertstream.backends.base import Backend
from expertstream.backends.tracing import EventTracer
from expertstream.timeline import OpKind, to_chrome_trace

N = 1 << 20


def test_event_tracer_records_every_operation_in_stream_order(backend: Backend) -> None:
    device = backend.device(0)
    stream = device.stream()
    buf = device.alloc(N)
    src = device.wrap_host(np.arange(N, dtype=np.uint8))
    out = np.zeros(N, dtype=np.uint8)
    dst = device.wrap_host(out)
    tracer = EventTracer()
    tracer.around(stream, OpKind.H2D, "copy_h2d", N, lambda: stream.copy_h2d(buf, 0, src, 0, N))
    tracer.around(stream, OpKind.MEMSET, "memset", 4096, lambda: stream.memset(buf, 0, 4096, 7))
    tracer.around(stream, OpKind.D2H, "copy_d2h", N, lambda: stream.copy_d2h(dst, 0, buf, 0, N))
    ops = tracer.timeline()
    stream.synchronize()
    assert [(op.kind, op.name, op.nbytes) for op in ops] == [
        (OpKind.H2D, "copy_h2d", N),
        (OpKind.MEMSET, "memset", 4096),
        (OpKind.D2H, "copy_d2h", N),
    ]
    assert all(op.start <= op.end for op in ops)
    assert all(a.end <= b.start + 1e-6 for a, b in itertools.pairwise(ops)), "one stream runs in order"
    assert {op.stream for op in ops} == {0} and {op.device for op in ops} == {0}
    assert (out[:4096] == 7).all() and np.array_equal(out[4096:], np.arange(N, dtype=np.uint8)[4096:])
    trace = to_chrome_trace(ops)
    assert sum(1 for e in trace["traceEvents"] if e["ph"] == "X") >= 3
    tracer.close()
    for res in (buf, src, dst, stream):
        res.close()


def test_start_trace_gives_a_timeline_on_every_backend(backend: Backend) -> None:
    device = backend.device(0)
    backend.start_trace()
    stream = device.stream()
    buf = device.alloc(N)
    src = device.wrap_host(np.ones(N, dtype=np.uint8))
    stream.copy_h2d(buf, 0, src, 0, N)
    stream.synchronize()
    timeline = backend.timeline
    assert timeline is not None
    copies = [op for op in timeline if op.kind is OpKind.H2D and op.nbytes == N]
    assert copies and copies[-1].end >= copies[-1].start
    for res in (buf, src, stream):
        res.close()
