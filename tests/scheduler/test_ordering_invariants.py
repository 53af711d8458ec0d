"""The scheduler's ordering rules, read off the simulator's timeline (enqueue order, all threads)."""

from __future__ import annotations

import pytest

import expertstream
from expertstream.backends.base import HostMemory
from expertstream.scheduler import Scheduler
from expertstream.timeline import OpKind

from . import plans

LAYERS = 9


@pytest.mark.parametrize("host", [HostMemory.PINNED, HostMemory.PAGEABLE])
@pytest.mark.parametrize("slots", [2, 3, 4, 8])
def test_waits_and_fires_follow_the_rules(slots: int, host: HostMemory) -> None:
    with expertstream.backend("sim") as backend:
        built = plans.build(backend, plans.uniform_specs(LAYERS, host=host), seed=slots)
        with Scheduler(slots=slots) as sched:
            compute = sched.stream(backend.device(0)).handle
            start = len(backend.timeline)
            sched.run(built.plan)
            ops = backend.timeline[start:]
        built.check()
        built.close()

    kernels = [i for i, op in enumerate(ops) if op.kind is OpKind.KERNEL]
    ready_waits = [i for i, op in enumerate(ops) if op.kind is OpKind.WAIT and op.stream == compute]
    copies = [i for i, op in enumerate(ops) if op.kind is OpKind.H2D]
    assert len(kernels) == len(ready_waits) == len(copies) == LAYERS  # one slot fill per split
    copy_stream = ops[copies[0]].stream
    assert copy_stream != compute

    for j in range(LAYERS):
        # Rule 1: the wait for split j comes after its copy and after split j-1's launch, and no
        # copy is enqueued between that launch and the wait.
        previous_launch = kernels[j - 1] if j else -1
        assert previous_launch < ready_waits[j] < kernels[j]
        assert ready_waits[j] > copies[j]
        assert not [c for c in copies if previous_launch < c < ready_waits[j] and c != copies[j]]
    if host is HostMemory.PAGEABLE:
        for j in range(LAYERS):
            # Rule 5: the copy worker enqueues split j's copy only once the wait for split j-1 is
            # enqueued, and only after the split that last read its slot was launched.
            assert j == 0 or ready_waits[j - 1] < copies[j]
            assert j < slots or kernels[j - slots] < copies[j]
    else:
        for i in range(LAYERS - slots + 1):
            # Rule 4: the copy for split i+N-1 is fired after split i is launched, before split i+1.
            ahead = copies[i + slots - 1]
            assert kernels[i] < ahead
            assert i + 1 == LAYERS or ahead < kernels[i + 1]
    for j in range(slots, LAYERS):
        # Rule 2: a copy into a reused slot sits behind a real wait on the copy stream.
        behind = [op for op in ops[: copies[j]] if op.stream == copy_stream and op.kind is not OpKind.MEMSET]
        assert behind[-1].kind is OpKind.WAIT and "never recorded" not in behind[-1].name


def _layers_over(devices: int, layout: str, host: HostMemory) -> list[plans.LayerSpec]:
    """LAYERS splits per device: alternating device by device, or in one block per device (a layer split)."""
    per_device = [plans.uniform_specs(LAYERS, host=host, device=d) for d in range(devices)]
    if layout == "alternate":
        return [specs[i] for i in range(LAYERS) for specs in per_device]
    return [spec for specs in per_device for spec in specs]


@pytest.mark.parametrize("layout", ["alternate", "blocks"])
@pytest.mark.parametrize("devices", [2, 3])
@pytest.mark.parametrize("slots", [2, 3, 8])
@pytest.mark.parametrize("profile", ["cuda-h200", "rocm-r9700"])
def test_pageable_copies_wait_for_their_own_device_s_previous_wait(
    profile: str, slots: int, devices: int, layout: str
) -> None:
    """Rules 1 and 5 for pageable sources, per device of several: no copy of a device goes out
    between its launch of split j-1 and its wait for split j but j's own, and j+1's only after
    that wait, whatever the other devices enqueue in between."""
    with expertstream.backend("sim", profile=profile, devices=devices) as backend:
        built = plans.build(backend, _layers_over(devices, layout, HostMemory.PAGEABLE), seed=slots)
        with Scheduler(slots=slots) as sched:
            computes = [sched.stream(device).handle for device in backend.devices]
            start = len(backend.timeline)
            sched.run(built.plan)
            ops = backend.timeline[start:]
        built.check()
        built.close()

    for index, compute in enumerate(computes):
        kernels = [i for i, op in enumerate(ops) if op.kind is OpKind.KERNEL and op.device == index]
        ready_waits = [i for i, op in enumerate(ops) if op.kind is OpKind.WAIT and op.stream == compute]
        copies = [i for i, op in enumerate(ops) if op.kind is OpKind.H2D and op.device == index]
        assert len(kernels) == len(ready_waits) == len(copies) == LAYERS
        for j in range(LAYERS):
            previous_launch = kernels[j - 1] if j else -1
            assert previous_launch < ready_waits[j] < kernels[j]
            assert copies[j] < ready_waits[j]
            assert not [c for c in copies if previous_launch < c < ready_waits[j] and c != copies[j]], (index, j)
            assert j == 0 or ready_waits[j - 1] < copies[j], (index, j)
