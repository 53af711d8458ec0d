"""Trace tracks are named by device, role and run, so a user can tell compute from copies."""

from __future__ import annotations

from expertstream.timeline import OpKind, TimelineOp, to_chrome_trace


def _op(kind: OpKind, start: float, stream: int | None, thread: int = 0) -> TimelineOp:
    device = None if stream is None else 0
    return TimelineOp(kind, kind.value, start, start + 1, thread, start, device=device, stream=stream)


def test_streams_are_named_compute_copy_and_run_and_host_copiers_workers() -> None:
    ops = [
        _op(OpKind.H2D, 0, 1),
        _op(OpKind.KERNEL, 1, 2),
        _op(OpKind.WAIT, 2, 2),
        _op(OpKind.KERNEL, 5, 3),  # a second run opens a new compute stream
        _op(OpKind.HOST_COPY, 0, None, thread=1),
    ]
    names = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in to_chrome_trace(ops)["traceEvents"]
        if e.get("name") == "thread_name"
    }
    assert names == {
        (1, 1): "copy",
        (1, 2): "compute (run 1)",
        (1, 3): "compute (run 2)",
        (0, 0): "host thread 0",
        (0, 1): "copy worker 1",
    }
