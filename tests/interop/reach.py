"""Whether the installed torch can work with a device's memory and streams."""

from __future__ import annotations

from typing import Any

import pytest

from expertstream.backends.base import Device
from expertstream.backends.dlpack import DLDeviceType


def torch_reaching(device: Device) -> Any:
    """torch, if it can read ``device``'s memory (CPU for the simulator); the test is skipped otherwise.

    A CUDA build of torch reaches CUDA devices only, a ROCm build ROCm devices only: the HIP
    backend over the HIP-to-CUDA shim has ROCm's device type but CUDA underneath.
    """
    torch = pytest.importorskip("torch", reason="torch is not installed")
    kind = device.dlpack_device[0]
    if kind is DLDeviceType.CPU:
        return torch
    built_for = DLDeviceType.ROCM if torch.version.hip else DLDeviceType.CUDA
    if kind is not built_for or not torch.cuda.is_available():
        pytest.skip(f"this torch ({torch.__version__}) cannot reach {device.label} ({kind.name} memory)")
    return torch
