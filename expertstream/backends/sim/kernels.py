"""Python twins of device kernels: what the simulator runs when a kernel is launched.

``device.compile(source, name, twin)`` on the simulator ignores the source and runs ``twin``;
code that compiles without one (tests, third parties) registers its twins here first with
``register_kernel``, and the simulator looks ``name`` up. A twin says what the kernel computes
(``run``), which bytes it reads and writes (``accesses``, for the hazard checker) and how much
work it is (``flops``, for virtual time).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...errors import InvalidArgument, KernelCompileError
from ..base import BufferView, Kernel

if TYPE_CHECKING:
    from ..base import Device
    from .profiles import Profile

log = logging.getLogger(__name__)

Dim3Tuple = tuple[int, int, int]


@dataclass(frozen=True)
class Access:
    """Bytes a kernel touches. ``padded_from``: where the padding tail of a quantized read starts.

    The bytes ``[padded_from, view.end)`` must hold zeros written by a zero fill (memset 0 or
    the zeroing at allocation); the hazard checker reports stale padding otherwise.
    """

    view: BufferView
    write: bool
    padded_from: int | None = None


@dataclass(frozen=True)
class KernelSpec:
    """A kernel's Python twin.

    ``run(args, grid, block)`` gets the launch arguments with every DeviceBuffer/BufferView
    replaced by a writable flat uint8 array of exactly its bytes; ``accesses(args)``,
    ``flops(args)`` and ``rate_key(args)`` get the arguments as given to launch.
    ``rate_key`` gives the (shape, size) under which a profile's measured kernel rates are looked
    up; without it a launch is looked up as (), flops.
    """

    name: str
    run: Callable[[tuple[Any, ...], Dim3Tuple, Dim3Tuple], None]
    accesses: Callable[[tuple[Any, ...]], Sequence[Access]]
    flops: Callable[[tuple[Any, ...]], float]
    rate_key: Callable[[tuple[Any, ...]], tuple[tuple[int, ...], float]] | None = None

    def seconds(self, args: tuple[Any, ...], profile: Profile) -> float:
        """How long one launch with ``args`` computes under ``profile`` (the launch latency aside)."""
        flops = float(self.flops(args))
        shape, size = self.rate_key(args) if self.rate_key is not None else ((), flops)
        return flops / profile.kernel_rate(self.name, shape, size)


_registry: dict[str, KernelSpec] = {}
_registry_lock = threading.Lock()


def register_kernel(spec: KernelSpec) -> KernelSpec:
    """Make ``spec`` the twin of kernel ``spec.name`` (a later registration replaces an earlier one)."""
    with _registry_lock:
        if spec.name in _registry and _registry[spec.name] is not spec:
            log.debug("kernel twin %r replaced", spec.name)
        _registry[spec.name] = spec
    return spec


def lookup_kernel(name: str, device_label: str) -> KernelSpec:
    with _registry_lock:
        spec = _registry.get(name)
    if spec is None:
        raise KernelCompileError(
            f"no Python twin is registered for kernel {name!r}",
            call=f"Device.compile({name!r})",
            device=device_label,
            hint="pass one, compile(source, name, twin=KernelSpec(name, run=..., accesses=..., flops=...)), or "
            "register it with expertstream.backends.sim.register_kernel(KernelSpec(...)) before compiling",
        )
    return spec


def checked_twin(twin: object, name: str, device_label: str) -> KernelSpec:
    """``twin`` as the twin of kernel ``name``: a KernelSpec of that name."""
    if not isinstance(twin, KernelSpec) or twin.name != name:
        given = f"the KernelSpec of {twin.name!r}" if isinstance(twin, KernelSpec) else type(twin).__name__
        raise InvalidArgument(
            f"the twin of kernel {name!r} must be a KernelSpec named {name!r}, got {given}",
            call=f"Device.compile({name!r})",
            device=device_label,
        )
    return twin


class SimKernel(Kernel):
    """A compiled kernel on the simulator: its twin, bound to one device."""

    def __init__(self, device: Device, spec: KernelSpec) -> None:
        super().__init__(device, spec.name)
        self.spec = spec


__all__ = ["Access", "KernelSpec", "SimKernel", "checked_twin", "lookup_kernel", "register_kernel"]
