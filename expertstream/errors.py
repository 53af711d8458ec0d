"""Every error expertstream raises on purpose.

Messages name the call, the device, the vendor code where there is one, and what the user can
do about it. Backends, the scheduler, the model code and the commands all raise these.
"""

from __future__ import annotations


class ExpertStreamError(Exception):
    """Base of every error this package raises on purpose."""


class BackendError(ExpertStreamError):
    """A backend call failed. The message names the call, device, code and a hint."""

    def __init__(
        self,
        message: str,
        *,
        call: str | None = None,
        device: str | None = None,
        code: str | None = None,
        hint: str | None = None,
    ) -> None:
        self.call = call
        self.device = device
        self.code = code
        self.hint = hint
        self.detail = message
        where = " on ".join(p for p in (call, device) if p)
        text = f"{where}: {message}" if where else message
        if code:
            text += f" [{code}]"
        if hint:
            text += f". {hint}"
        super().__init__(text)

    def with_detail(self, message: str) -> BackendError:
        """The same error (type, call, device, code, hint) with a fuller message."""
        return type(self)(message, call=self.call, device=self.device, code=self.code, hint=self.hint)


class BackendUnavailable(BackendError):
    """The requested backend cannot run here (missing library, driver or device)."""


class OutOfDeviceMemory(BackendError, MemoryError):
    """A device allocation did not fit."""


class InvalidArgument(BackendError, ValueError):
    """A call got an argument that can never work (range, type, device mismatch)."""


class UseAfterClose(BackendError):
    """An operation touched a buffer, stream or event that was already closed."""


class KernelCompileError(BackendError):
    """Run-time compilation (NVRTC / hipRTC) failed; the message carries the log."""


class DeviceError(BackendError):
    """Any other failure reported by the driver or runtime."""


class HazardError(BackendError):
    """The simulated backend found a missing ordering (a race) or another silent bug."""


__all__ = [
    "BackendError",
    "BackendUnavailable",
    "DeviceError",
    "ExpertStreamError",
    "HazardError",
    "InvalidArgument",
    "KernelCompileError",
    "OutOfDeviceMemory",
    "UseAfterClose",
]
