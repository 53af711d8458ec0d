"""Plans over two devices on every backend that has them: each device its own slots, right bytes.

The first lookahead kept one prefetch state for all devices and put slots on the wrong one.
On the simulator two devices are opened here; a GPU backend needs two and skips otherwise.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

import expertstream
from expertstream.backends.base import Backend, HostMemory
from expertstream.scheduler import Scheduler

from . import plans


@pytest.fixture(scope="module")
def two(backend_name: str, backend: Backend) -> Iterator[Backend]:
    if backend_name == "sim":
        with expertstream.backend("sim", devices=2, peer_access=True) as sim:
            yield sim
        return
    if len(backend.devices) < 2:
        pytest.skip(f"{backend_name}: {len(backend.devices)} device(s); these tests need two")
    yield backend


@pytest.mark.parametrize("host", [HostMemory.PINNED, HostMemory.REGISTERED, HostMemory.PAGEABLE])
def test_each_device_keeps_its_slots_and_gets_its_bytes(two: Backend, host: HostMemory) -> None:
    first = plans.uniform_specs(6, device=0, host=host)
    second = plans.uniform_specs(6, device=1, host=host)
    specs = [s for pair in zip(first, second, strict=True) for s in pair]  # devices alternate split by split
    built = plans.build(two, specs, seed=21)
    try:
        for slots in (3, 0, 2, 8):
            with Scheduler(slots=slots) as scheduler:
                stats = scheduler.run(built.plan)
                for device, prefetch in scheduler._prefetch.items():
                    assert all(slot.buffer.device is device for slot in prefetch._slots)
            consumed = [stats.device(d.label).consumed for d in two.devices[:2]]
            assert consumed == ([6, 6] if slots else [0, 0]), (slots, consumed)
            built.check()
    finally:
        built.close()


def test_random_plans_over_two_devices_give_the_host_bytes(two: Backend) -> None:
    rng = np.random.default_rng(5)
    for _ in range(4):
        built = plans.build(two, plans.random_specs(rng, 10, 2, prefill_share=0.7, resident_share=0.2), seed=7)
        try:
            for slots in (0, 3):
                with Scheduler(slots=slots) as scheduler:
                    scheduler.run(built.plan)
                built.check()
        finally:
            built.close()
