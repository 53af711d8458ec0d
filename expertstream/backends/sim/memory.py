"""Simulated device and host memory.

Device buffers are numpy uint8 arrays in data mode and bare sizes in timing-only mode. A
fresh device buffer holds a garbage pattern, as real device memory does, so reading bytes
nothing wrote shows up in results.
"""

from __future__ import annotations

import mmap
import sys
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import InvalidArgument
from ..base import DeviceBuffer, HostBuffer, HostMemory, Usage

if TYPE_CHECKING:
    from .device import SimDevice

GARBAGE_BYTE = 0xCD
# Python exposes MAP_NORESERVE only from 3.13; without it Linux refuses mappings larger than
# the commit limit even though nothing is ever written to them.
_LINUX_NORESERVE = 0x4000 if sys.platform.startswith("linux") else 0


class SimDeviceBuffer(DeviceBuffer):
    def __init__(
        self, device: SimDevice, nbytes: int, alloc_size: int, usage: Usage, address: int, array: np.ndarray | None
    ) -> None:
        super().__init__(device, nbytes, alloc_size, usage)
        self.sim_device = device
        self._address = address
        self.array = array  # None in timing-only mode

    @property
    def address(self) -> int:
        return self._address if self.alloc_size else 0

    def _free(self) -> None:
        self.sim_device.release(self)
        self.array = None

    def _dlpack_pointer(self) -> int:
        if self.array is None:
            raise InvalidArgument(
                "a timing-only simulator holds no bytes to export",
                call="__dlpack__",
                device=self.device.label,
                hint="open the simulator with data=True",
            )
        return int(self.array.ctypes.data)

    def read(self, offset: int = 0, nbytes: int | None = None) -> np.ndarray:
        if self.array is None and not self.closed:
            raise InvalidArgument(
                "a timing-only simulator holds no data to read",
                call="DeviceBuffer.read",
                device=self.device.label,
                hint="open the simulator with data=True",
            )
        return super().read(offset, nbytes)


class SimHostBuffer(HostBuffer):
    """Host memory handed out by the simulator; closing it checks for copies still using it."""

    def __init__(self, device: SimDevice, array: np.ndarray, kind: HostMemory, *, owner: Any = None) -> None:
        super().__init__(device, array, kind, owner=owner)
        self.sim_device = device

    def close(self) -> None:
        if not self.closed:
            self.sim_device.sim.check_release(self, "HostBuffer.close")
        super().close()


def untouched_host_bytes(nbytes: int) -> tuple[np.ndarray, Any]:
    """``nbytes`` of host address space that takes no memory until written, and its owner.

    Timing-only runs use it to stand for tens of gigabytes of expert weights.
    """
    if nbytes == 0:
        empty = np.empty(0, dtype=np.uint8)
        return empty, empty
    flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0) | getattr(mmap, "MAP_NORESERVE", _LINUX_NORESERVE)
    mapping = mmap.mmap(-1, nbytes, flags=flags)
    return np.frombuffer(mapping, dtype=np.uint8), mapping


__all__ = ["GARBAGE_BYTE", "SimDeviceBuffer", "SimHostBuffer", "untouched_host_bytes"]
