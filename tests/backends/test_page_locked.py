"""Every backend counts the host memory it page-locks, so leaks show as a number."""

from __future__ import annotations

import numpy as np

from expertstream.backends.base import Device


def test_pinned_and_registered_bytes_are_counted_until_released(device: Device) -> None:
    baseline = device.page_locked_bytes
    pinned = device.alloc_pinned(1 << 16)
    assert device.page_locked_bytes == baseline + (1 << 16)
    wrapped = device.wrap_host(np.zeros(3 << 12, dtype=np.uint8))
    assert device.page_locked_bytes == baseline + (1 << 16), "wrapping alone locks nothing"
    if device.capabilities.host_register:
        wrapped.register()
        assert device.page_locked_bytes == baseline + (1 << 16) + (3 << 12)
        wrapped.unregister()
    assert device.page_locked_bytes == baseline + (1 << 16)
    if device.capabilities.host_register:
        wrapped.register()
    wrapped.close()  # closing a registered buffer unregisters it
    pinned.close()
    pinned.close()  # twice is harmless and counts once
    assert device.page_locked_bytes == baseline
