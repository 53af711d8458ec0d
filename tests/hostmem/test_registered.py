"""Registered mode where the platform allows it, and its single, recorded fallback where not."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import expertstream
from expertstream.backends.base import Backend
from expertstream.errors import DeviceError
from expertstream.hostmem import HostMemoryFallback, HostMemoryMode, HostWeights, RingOptions

SMALL_RING = RingOptions(chunk_bytes=50_000, chunks=3, threads=2)


@pytest.fixture
def sim_h200() -> Iterator[Backend]:
    with expertstream.backend("sim", profile="cuda-h200") as be:
        yield be


@pytest.fixture
def sim_r9700() -> Iterator[Backend]:
    # HIP exposes no read-only registration, so a read-only file mapping cannot be registered.
    with expertstream.backend("sim", profile="rocm-r9700") as be:
        yield be


def _round_trips(weights: HostWeights) -> bool:
    device = weights.device
    for name in weights:
        source = weights[name]
        dst = device.alloc(source.nbytes)
        with device.stream() as stream:
            source.enqueue_h2d(stream, dst, 0, 0, source.nbytes)
            stream.synchronize()
        same = np.array_equal(dst.read(), weights.model.raw(name))
        dst.close()
        if not same:
            return False
    return True


def test_registered_mapping_where_supported(sim_h200: Backend, tiny_path: Path) -> None:
    with HostWeights.open(tiny_path, sim_h200.device(0), HostMemoryMode.REGISTERED) as weights:
        assert weights.mode is HostMemoryMode.REGISTERED
        assert weights.stats.fallbacks == []
        assert weights.stats.registered_bytes == tiny_path.stat().st_size
        assert weights.stats.pinned_bytes == 0
        assert not any(weights[name].blocks_host for name in weights)
        assert _round_trips(weights)


def test_refused_registration_falls_back_to_ring_with_one_warning(
    sim_r9700: Backend, tiny_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    device = sim_r9700.device(0)
    with caplog.at_level(logging.INFO, logger="expertstream.hostmem"):
        weights = HostWeights.open(tiny_path, device, HostMemoryMode.REGISTERED, ring=SMALL_RING)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, caplog.text
    message = warnings[0].getMessage()
    assert device.label in message and "read-only host registration is not supported" in message
    assert "staging ring of 3 x 50000 pinned bytes" in message
    assert weights.mode is HostMemoryMode.RING
    assert weights.stats.fallbacks == [
        HostMemoryFallback(
            HostMemoryMode.REGISTERED, HostMemoryMode.RING, "read-only host registration is not supported"
        )
    ]
    assert weights.stats.registered_bytes == 0
    assert _round_trips(weights)
    weights.close()


def test_the_preferred_mode_registers_where_supported(sim_h200: Backend, tiny_path: Path) -> None:
    with HostWeights.open(tiny_path, sim_h200.device(0)) as weights:
        assert weights.mode is HostMemoryMode.REGISTERED
        assert weights.stats.fallbacks == []


def test_the_preferred_mode_uses_the_ring_elsewhere_without_a_warning(
    sim_r9700: Backend, tiny_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="expertstream.hostmem"):
        weights = HostWeights.open(tiny_path, sim_r9700.device(0), "preferred", ring=SMALL_RING)
    assert weights.mode is HostMemoryMode.RING
    assert [f.requested for f in weights.stats.fallbacks] == [HostMemoryMode.PREFERRED]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert _round_trips(weights)
    weights.close()


def test_runtime_refusal_falls_back_and_names_the_error(
    sim_h200: Backend, tiny_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    device = sim_h200.device(0)

    def refuse(host: object, read_only: bool) -> None:
        raise DeviceError("registering the mapping failed", call="cudaHostRegister", code="cudaErrorInvalidValue")

    monkeypatch.setattr(device, "_host_register", refuse)
    with caplog.at_level(logging.WARNING, logger="expertstream.hostmem"):
        weights = HostWeights.open(tiny_path, device, "registered", ring=SMALL_RING)
    assert weights.mode is HostMemoryMode.RING
    (fallback,) = weights.stats.fallbacks
    assert fallback.reason == "registering the mapping failed [cudaErrorInvalidValue]"
    assert len(caplog.records) == 1 and "cudaErrorInvalidValue" in caplog.records[0].getMessage()
    assert _round_trips(weights)
    weights.close()
