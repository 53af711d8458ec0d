"""The simulated backend: devices sharing one simulation core, its timeline and host clocks."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from ...timeline import TimelineOp
from ..base import Backend, Vendor
from .core import Simulation
from .device import SimDevice
from .host import SimHost
from .profiles import Profile


class SimBackend(Backend):
    """Devices that run on numpy memory (or on sizes alone) in virtual time, checking for hazards."""

    name = "sim"
    vendor = Vendor.SIM

    def __init__(self, profile: Profile, *, devices: int, peer_access: bool, data: bool, check_hazards: bool) -> None:
        self._sim = Simulation(profile, data=data, check_hazards=check_hazards)
        super().__init__(SimHost(self._sim, self))
        self._devices = tuple(SimDevice(self, i, self._sim, peer_access) for i in range(devices))

    @property
    def devices(self) -> Sequence[SimDevice]:
        return self._devices

    def device(self, index: int = 0) -> SimDevice:
        device = super().device(index)
        assert isinstance(device, SimDevice)
        return device

    @property
    def profile(self) -> Profile:
        return self._sim.profile

    @property
    def check_hazards(self) -> bool:
        return self._sim.checker is not None

    @property
    def timeline(self) -> tuple[TimelineOp, ...]:
        """Every operation so far, in enqueue order (see expertstream.timeline for trace export)."""
        return self._sim.timeline()

    def mark(self, name: str) -> None:
        self._sim.mark(name)

    def host_time(self) -> float:
        """The calling thread's virtual clock in seconds."""
        return self._sim.clocks.now()

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        out["profile"] = dataclasses.asdict(self.profile)
        out["data"] = self.host.holds_data
        out["check_hazards"] = self.check_hazards
        return out


__all__ = ["SimBackend"]
