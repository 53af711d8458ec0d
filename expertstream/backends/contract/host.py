"""The host as a backend stands for it: ``backend.host``, which only the simulator fills in.

The simulator keeps a virtual clock per host thread; work handed from one thread to another (a
copy worker, a fill pool) carries the sender's timestamp so the receiver cannot start it earlier,
and a memcpy between host buffers takes that thread's virtual time. A simulator profile may also
describe another machine's staging ring. Real GPUs need nothing more than the wall clock, a plain
memcpy and this host's own defaults: what ``Host`` does.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np

from ...errors import InvalidArgument
from .memory import HostBuffer, check_range, check_sharing


class Host:
    """The host's threads, clock and memcpy as a backend sees them; on real GPUs, this host as it is."""

    def timestamp(self) -> float:
        """The calling thread's clock in seconds (virtual on the simulator)."""
        return time.perf_counter()

    def resume_at(self, timestamp: float) -> None:
        """Tell the backend the calling thread is now at least at ``timestamp`` (a handoff)."""

    @contextmanager
    def bare_calls(self) -> Iterator[None]:
        """The calling thread's calls inside come back to back, with none of its caller's work
        between them (a staging ring's DMAs and records; a decode step's copies of expert ranges one
        by one; a probe's launches): the simulator charges them its profile's ``call_s`` rather than
        the job's time per call. A no-op elsewhere."""
        yield

    @property
    def virtual_time(self) -> bool:
        """True where time is simulated: work done outside this process's threads takes none of it."""
        return False

    @property
    def holds_data(self) -> bool:
        """False when buffers hold no bytes (the simulator's timing-only mode): outputs are meaningless."""
        return True

    @property
    def ring_threads(self) -> int | None:
        """Host threads a staging ring runs on the machine this backend stands for, where it says
        (a simulator profile describing another machine); None: this host's default."""
        return None

    @property
    def ring_fill(self) -> str | None:
        """Who fills a staging ring's chunks on the machine this backend stands for, where it says (a
        simulator profile's "threads" or "processes"); None: what this host can run."""
        return None

    def copy(
        self,
        dst: HostBuffer,
        dst_offset: int,
        src: HostBuffer,
        src_offset: int,
        nbytes: int,
        *,
        sharing: int = 1,
        fixed_cost: bool = True,
    ) -> None:
        """A memcpy between host buffers in the calling thread (the simulator charges its time).

        ``sharing``: how many such copies the caller runs at once on its threads, this one
        included. The simulator gives each that share of the host's memory bus. ``fixed_cost``:
        whether the copy pays the simulator's fixed cost per copy (False: one in a row the thread
        was handed while busy, as a fill process takes its next command without waking).
        """
        check_copy(dst, dst_offset, src, src_offset, nbytes, sharing)
        np.copyto(dst.array[dst_offset : dst_offset + nbytes], src.array[src_offset : src_offset + nbytes])

    def read_into(
        self,
        dst: HostBuffer,
        dst_offset: int,
        nbytes: int,
        read: Callable[[memoryview], None],
        *,
        sharing: int = 1,
        cached: bool = False,
    ) -> None:
        """``read`` writes bytes ``[dst_offset, dst_offset + nbytes)`` of ``dst`` in the calling thread
        (a file read into a staging chunk). The simulator checks the write as it checks a copy's and
        charges it as a read from its profile's drive with ``sharing`` reads in flight, this one
        included, or, where ``cached`` (the bytes come out of the page cache), as a memcpy sharing
        the host memory bus with ``sharing`` others."""
        check_read_into(dst, dst_offset, nbytes, sharing)
        read(dst.array[dst_offset : dst_offset + nbytes].data)


def check_copy(dst: HostBuffer, dst_offset: int, src: HostBuffer, src_offset: int, nbytes: int, sharing: int) -> None:
    """The checks of every ``Host.copy``: both ranges inside open buffers, a count of copies sharing the bus."""
    call = "Host.copy"
    check_range(call, dst, dst_offset, nbytes)
    check_range(call, src, src_offset, nbytes)
    check_sharing(call, sharing)


def check_read_into(dst: HostBuffer, dst_offset: int, nbytes: int, sharing: int) -> None:
    """The checks of every ``Host.read_into``: the range inside an open, writable buffer."""
    call = "Host.read_into"
    check_range(call, dst, dst_offset, nbytes)
    check_sharing(call, sharing)
    if dst.read_only:
        raise InvalidArgument("cannot read into read-only host memory", call=call, device=dst.device.label)


__all__ = ["Host", "check_copy", "check_read_into"]
