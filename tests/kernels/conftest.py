"""Fixtures of the kernel tests: one MoeKernels per module and backend, a stream per test."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from expertstream.backends.base import Device, Stream
from expertstream.kernels import MoeKernels


@pytest.fixture(scope="module")
def kernels(device: Device) -> Iterator[MoeKernels]:
    with MoeKernels(device) as k:
        yield k
        device.synchronize()


@pytest.fixture
def stream(device: Device) -> Iterator[Stream]:
    with device.stream() as s:
        yield s


@pytest.fixture
def rng() -> np.random.Generator:
    """Fresh inputs every run: the kernels must compute the function on any valid input."""
    return np.random.default_rng()
