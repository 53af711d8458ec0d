"""The simulated machine's host: per-thread virtual clocks, timed memcpy and drive reads, the profile's staging ring."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ..base import Backend, Host, HostBuffer
from ..contract.host import check_copy, check_read_into
from .core import Simulation
from .engine import HostTimestamp
from .hazards import Touch
from .streams import check_own_host


class SimHost(Host):
    """The host of the machine a profile describes, in virtual time, its accesses checked for hazards."""

    def __init__(self, sim: Simulation, backend: Backend) -> None:
        self._sim = sim
        self._backend = backend

    def timestamp(self) -> HostTimestamp:
        return self._sim.host_timestamp()

    def resume_at(self, timestamp: float) -> None:
        self._sim.host_resume_at(timestamp)

    @contextmanager
    def bare_calls(self) -> Iterator[None]:
        with self._sim.bare_calls():
            yield

    @property
    def virtual_time(self) -> bool:
        return True

    @property
    def holds_data(self) -> bool:
        """False in timing-only mode: no memory behind buffers, kernels not run."""
        return self._sim.data

    @property
    def ring_threads(self) -> int | None:
        return self._sim.profile.ring_threads

    @property
    def ring_fill(self) -> str | None:
        return self._sim.profile.ring_fill

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
        """A memcpy on the calling thread, which it pays for at the profile's one-thread rate or at
        its share of the host memory bus, whichever is lower, after the profile's fixed cost per
        copy where ``fixed_cost``."""
        check_copy(dst, dst_offset, src, src_offset, nbytes, sharing)
        check_own_host(self._backend, src, "Host.copy")
        check_own_host(self._backend, dst, "Host.copy")
        self._sim.host_access(
            (
                Touch(src, src_offset, src_offset + nbytes, write=False),
                Touch(dst, dst_offset, dst_offset + nbytes, write=True),
            ),
            "host copy",
            "Host.copy",
        )
        if self._sim.data:  # timing-only: placeholder memory is never touched
            super().copy(dst, dst_offset, src, src_offset, nbytes, sharing=sharing, fixed_cost=fixed_cost)
        self._sim.host_copy(nbytes, sharing, fixed_cost=fixed_cost)

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
        """A read into host memory on the calling thread, checked as a copy's write and timed as a read
        from the profile's drive with ``sharing`` reads in flight, or, ``cached``, as a memcpy."""
        check_read_into(dst, dst_offset, nbytes, sharing)
        check_own_host(self._backend, dst, "Host.read_into")
        self._sim.host_access((Touch(dst, dst_offset, dst_offset + nbytes, write=True),), "host read", "Host.read_into")
        if self._sim.data:  # timing-only: placeholder memory is never touched
            super().read_into(dst, dst_offset, nbytes, read, sharing=sharing, cached=cached)
        if cached:
            self._sim.host_copy(nbytes, sharing)
        else:
            self._sim.host_read(nbytes, sharing)


__all__ = ["SimHost"]
