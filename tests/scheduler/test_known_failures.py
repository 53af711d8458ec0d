"""Each silent bug of the first lookahead attempt, built by hand from backend primitives.

The wrong variant must be caught (a HazardError, a typed error, or a measurable delay on the
simulated timeline); the right variant, which is what the scheduler does, must pass.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

import expertstream
from expertstream.backends.base import HostMemory, Usage
from expertstream.errors import HazardError, InvalidArgument
from expertstream.ggml import padded_size
from expertstream.scheduler import Input, MulMatId, Plan, Scheduler, Split
from microbench import ordering

from . import plans

READ = "es_test_read"


def _register_read_twin() -> None:
    from expertstream.backends.sim import Access, KernelSpec, register_kernel

    def accesses(args: tuple) -> list:
        view, padded_from = args[0], int(args[1])
        return [Access(view, write=False, padded_from=view.offset + padded_from if padded_from >= 0 else None)]

    register_kernel(KernelSpec(READ, run=lambda a, g, b: None, accesses=accesses, flops=lambda a: 1e6))


@pytest.fixture
def sim2():
    _register_read_twin()
    with expertstream.backend("sim", devices=2, peer_access=True) as be:
        yield be


def _read(stream, kernel, view, padded_from: int = -1) -> None:
    stream.launch(kernel, 1, 1, (view, np.int64(padded_from)))


def test_slot_on_another_device_is_caught(sim2) -> None:
    dev0, dev1 = sim2.devices
    slot = dev0.alloc(4096, Usage.COMPUTE)
    host = dev0.wrap_host(np.arange(4096, dtype=np.uint8))
    copy0, compute1 = dev0.stream(), dev1.stream()
    ready = dev0.event()
    copy0.copy_h2d(slot, 0, host, 0, 4096)
    copy0.record(ready)
    compute1.wait(ready)
    kernel1 = dev1.compile("", READ)
    with pytest.raises(HazardError, match="cross-device"):
        _read(compute1, kernel1, slot.view())


def test_slot_on_another_device_with_peer_access_but_wrong_wait_is_caught(sim2) -> None:
    dev0, dev1 = sim2.devices
    dev1.enable_peer_access(dev0)
    slot = dev0.alloc(4096, Usage.COMPUTE)
    host = dev0.wrap_host(np.arange(4096, dtype=np.uint8))
    copy0, compute0, compute1 = dev0.stream(), dev0.stream(), dev1.stream()
    ready = dev0.event()
    copy0.copy_h2d(slot, 0, host, 0, 4096)
    copy0.record(ready)
    compute0.wait(ready)  # one prefetch state for both devices: the wait lands on device 0's stream
    with pytest.raises(HazardError, match="read-after-write"):
        _read(compute1, dev1.compile("", READ), slot.view())


def test_each_device_keeps_its_prefetch_slots_on_itself(sim2) -> None:
    specs = plans.uniform_specs(4, device=0) + plans.uniform_specs(4, device=1)
    specs = [s for pair in zip(specs[:4], specs[4:], strict=True) for s in pair]  # alternate devices
    built = plans.build(sim2, specs, seed=11)
    with Scheduler(slots=3) as sched:
        stats = sched.run(built.plan)
        for device, prefetch in sched._prefetch.items():
            assert all(slot.buffer.device is device for slot in prefetch._slots)
    assert all(stats.device(d.label).consumed == 4 for d in sim2.devices)
    built.check()
    built.close()


def test_freeing_a_slot_with_an_outstanding_fire_is_caught(sim2) -> None:
    dev = sim2.device(0)
    slot = dev.alloc(1 << 20, Usage.COMPUTE)
    host = dev.wrap_host(np.ones(1 << 20, dtype=np.uint8))
    copy = dev.stream()
    copy.copy_h2d(slot, 0, host, 0, 1 << 20)  # pinned-speed or not, it is still in flight
    with pytest.raises(HazardError, match="use-after-free"):
        slot.close()


def test_freeing_a_slot_a_pending_kernel_reads_is_caught(sim2) -> None:
    dev = sim2.device(0)
    slot = dev.upload(np.ones(1 << 16, dtype=np.uint8))
    compute = dev.stream()
    _read(compute, dev.compile("", READ), slot.view())
    with pytest.raises(HazardError, match="use-after-free"):
        slot.close()
    compute.synchronize()
    slot.close()  # drained first: fine


def test_disabling_the_ring_drains_before_freeing(sim2) -> None:
    built = plans.build(sim2, plans.uniform_specs(6), seed=12)
    with Scheduler(slots=4) as sched:
        sched.run(built.plan)
        sched.slots = 0  # frees every slot; the hazard checker would raise on a pending user
        sched.slots = 3
        sched.run(built.plan)
    built.check()
    built.close()


def test_device_resident_weights_never_go_through_a_host_copy(sim2) -> None:
    dev = sim2.device(0)
    weights = dev.upload(np.arange(4096, dtype=np.uint8), Usage.WEIGHTS)
    slot = dev.alloc(4096, Usage.COMPUTE)
    with pytest.raises(InvalidArgument, match="source must be a HostBuffer"):
        dev.stream().copy_h2d(slot, 0, weights, 0, 4096)  # type: ignore[arg-type]

    ids = dev.upload(np.zeros(8, dtype=np.int32))
    seen = {}
    split = Split(
        "resident",
        dev,
        (Input("w", 4096, device_data=weights.view(), expert_nbytes=1024),),
        compute=lambda stream, bindings: seen.update(bindings),
        mul_mat_id=MulMatId(ids.view(), 8, 4, ("w",)),
    )
    with Scheduler(slots=3) as sched:
        stats = sched.run(Plan.of([split]))
    assert seen["w"] == weights.view()
    assert stats.device(dev.label).fires == 0 and stats.device(dev.label).bytes_stock == 0


def _rotate(dev, clear_tail: bool) -> None:
    # Q4_0 (18 bytes per 32 elements): 64 rows of 768 elements, then 4 rows of 544.
    big_nbytes, small_nbytes = 64 * 18 * 24, 4 * 18 * 17
    size = padded_size(big_nbytes, Q.Q4_0, 768)
    slot = dev.alloc(size, Usage.COMPUTE)
    stream = dev.stream()
    kernel = dev.compile("", READ)
    rng = np.random.default_rng(0)
    for nbytes, ne0 in ((big_nbytes, 768), (small_nbytes, 544)):
        host = dev.wrap_host(rng.integers(0, 256, nbytes, dtype=np.uint8))
        stream.copy_h2d(slot, 0, host, 0, nbytes)
        padded = padded_size(nbytes, Q.Q4_0, ne0)
        if clear_tail:
            stream.memset(slot, nbytes, padded - nbytes, 0)
        _read(stream, kernel, slot.view(0, padded), nbytes)
    stream.synchronize()


def test_stale_padding_after_rotation_is_caught(sim2) -> None:
    with pytest.raises(HazardError, match="stale padding"):
        _rotate(sim2.device(0), clear_tail=False)


def test_cleared_padding_after_rotation_passes(sim2) -> None:
    _rotate(sim2.device(0), clear_tail=True)


@pytest.mark.parametrize("profile", ["rocm-r9700", "cuda-h200"])
def test_wait_after_the_next_copy_delays_the_next_split(profile: str) -> None:
    wrong = ordering.run_pattern(profile, HostMemory.PAGEABLE, "wait-after-copy", n_splits=6)
    right = ordering.run_pattern(profile, HostMemory.PAGEABLE, "scheduler", n_splits=6)
    # The wrong order holds split i+1 until the i+2 copy ends: several ms per split.
    assert wrong.max_stall_ms > 5.0
    assert right.max_stall_ms < 0.5  # launch latency only
    assert right.wall_ms < wrong.wall_ms


def test_with_pinned_memory_both_orders_behave_the_same() -> None:
    wrong = ordering.run_pattern("rocm-r9700", HostMemory.PINNED, "wait-after-copy", n_splits=6)
    right = ordering.run_pattern("rocm-r9700", HostMemory.PINNED, "scheduler", n_splits=6)
    assert wrong.max_stall_ms < 0.5 and right.max_stall_ms < 0.5
    assert wrong.wall_ms == pytest.approx(right.wall_ms, rel=1e-3)
