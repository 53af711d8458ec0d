"""What ran where and when: a backend-neutral record of device and host operations.

Any backend can fill a list of TimelineOp (the simulator does it for every operation);
``to_chrome_trace`` turns it into Chrome/Perfetto trace JSON with one track per stream and
one per host thread, so a schedule can be inspected in chrome://tracing or ui.perfetto.dev.
"""

from __future__ import annotations

import enum
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

_HOST_PID = 0
_US_PER_S = 1e6


class OpKind(str, enum.Enum):
    H2D = "h2d"
    D2H = "d2h"
    D2D = "d2d"
    MEMSET = "memset"
    KERNEL = "kernel"
    WAIT = "wait"
    RECORD = "record"
    HOST_COPY = "host_copy"  # a memcpy between host buffers on a host thread
    HOST_SYNC = "host_sync"  # a host thread blocked in synchronize / event synchronize
    HOST_REGISTER = "host_register"  # page-locking host memory in place
    MARK = "mark"  # a moment the host named (Backend.mark): where one phase of a run hands over to the next


@dataclass(frozen=True)
class TimelineOp:
    """One operation. Times are seconds on the backend's clock (virtual on the simulator)."""

    kind: OpKind
    name: str
    start: float
    end: float
    thread: int  # index of the host thread that issued it, in order of first appearance
    issued: float  # when the host thread issued it
    device: int | None = None  # None for host-only operations
    stream: int | None = None
    stream_name: str = ""
    nbytes: int = 0
    host_blocked: bool = False  # the issuing thread could not go on before ``end``


_COPIES = frozenset({OpKind.H2D, OpKind.D2H, OpKind.D2D, OpKind.MEMSET})


def _stream_roles(ops: list[TimelineOp]) -> dict[tuple[int, int], str]:
    """A name per (device, stream): its role (compute: runs kernels; copy: only copies) and run.

    A scheduler opens its streams per run, so the k-th stream of a role on a device is run k. A
    name a backend gave the stream (other than the default "stream N") is kept instead.
    """
    kinds: dict[tuple[int, int], set[OpKind]] = {}
    given: dict[tuple[int, int], str] = {}
    first: dict[tuple[int, int], float] = {}
    for op in ops:
        if op.device is not None and op.stream is not None:
            key = (op.device, op.stream)
            kinds.setdefault(key, set()).add(op.kind)
            given.setdefault(key, op.stream_name)
            first[key] = min(first.get(key, op.start), op.start)
    roles = {
        key: ("compute" if OpKind.KERNEL in found else "copy" if found & _COPIES else "events")
        for key, found in kinds.items()
    }
    counts: dict[tuple[int, str], int] = {}
    for (dev, _), role in roles.items():
        counts[(dev, role)] = counts.get((dev, role), 0) + 1
    seen: dict[tuple[int, str], int] = {}
    names: dict[tuple[int, int], str] = {}
    for key in sorted(roles, key=lambda k: (k[0], first[k])):
        dev, role = key[0], roles[key]
        seen[(dev, role)] = seen.get((dev, role), 0) + 1
        name = f"{role} (run {seen[(dev, role)]})" if counts[(dev, role)] > 1 else role
        custom = given[key] and not given[key].startswith("stream ")
        names[key] = given[key] if custom else name
    return names


def _thread_roles(ops: list[TimelineOp]) -> dict[int, str]:
    """Threads other than the first that only copy between host buffers are copy workers."""
    names: dict[int, str] = {}
    for thread in sorted({op.thread for op in ops}):
        own = {op.kind for op in ops if op.thread == thread}
        worker = thread != 0 and own <= {OpKind.HOST_COPY, OpKind.HOST_SYNC, OpKind.HOST_REGISTER}
        names[thread] = f"copy worker {thread}" if worker else f"host thread {thread}"
    return names


def _track_names(ops: list[TimelineOp]) -> list[dict[str, Any]]:
    meta: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": _HOST_PID, "args": {"name": "host"}},
    ]
    devices = sorted({op.device for op in ops if op.device is not None})
    for dev in devices:
        meta.append({"ph": "M", "name": "process_name", "pid": dev + 1, "args": {"name": f"device {dev}"}})
    for (dev, stream), name in sorted(_stream_roles(ops).items()):
        meta.append({"ph": "M", "name": "thread_name", "pid": dev + 1, "tid": stream, "args": {"name": name}})
    for thread, name in _thread_roles(ops).items():
        meta.append({"ph": "M", "name": "thread_name", "pid": _HOST_PID, "tid": thread, "args": {"name": name}})
    return meta


def _span(op: TimelineOp, pid: int, tid: int, start: float, end: float, name: str) -> dict[str, Any]:
    return {
        "name": name,
        "cat": op.kind.value,
        "ph": "X",
        "pid": pid,
        "tid": tid,
        "ts": start * _US_PER_S,
        "dur": (end - start) * _US_PER_S,
        "args": {"kind": op.kind.value, "bytes": op.nbytes, "host_blocked": op.host_blocked},
    }


def _events(op: TimelineOp) -> list[dict[str, Any]]:
    if op.kind is OpKind.MARK:  # an instant across every track: Perfetto draws a line there
        return [
            {
                "name": op.name,
                "cat": op.kind.value,
                "ph": "i",
                "s": "g",
                "pid": _HOST_PID,
                "tid": op.thread,
                "ts": op.start * _US_PER_S,
            }
        ]
    if op.device is None or op.stream is None:
        return [_span(op, _HOST_PID, op.thread, op.start, op.end, op.name)]
    out: list[dict[str, Any]]
    if op.kind is OpKind.RECORD:
        # A record takes no time: an instant marker on its stream's track.
        out = [
            {
                "name": op.name,
                "cat": op.kind.value,
                "ph": "i",
                "s": "t",
                "pid": op.device + 1,
                "tid": op.stream,
                "ts": op.start * _US_PER_S,
            }
        ]
    else:
        out = [_span(op, op.device + 1, op.stream, op.start, op.end, op.name)]
    if op.host_blocked and op.end > op.issued:
        out.append(_span(op, _HOST_PID, op.thread, op.issued, op.end, f"blocked in {op.name}"))
    return out


def to_chrome_trace(ops: Iterable[TimelineOp]) -> dict[str, Any]:
    """Chrome/Perfetto trace-event JSON: a process per device with a track per stream, plus host threads."""
    op_list = list(ops)
    events = _track_names(op_list)
    for op in op_list:
        events.extend(_events(op))
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(ops: Iterable[TimelineOp], path: str | os.PathLike[str]) -> None:
    """Write ``to_chrome_trace(ops)`` to ``path`` as JSON."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(to_chrome_trace(ops), f)


__all__ = ["OpKind", "TimelineOp", "to_chrome_trace", "write_chrome_trace"]
