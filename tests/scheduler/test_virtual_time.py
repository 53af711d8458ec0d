"""More slots never make a run slower, in the simulator's virtual time (deterministic, not wall time),
unless the launching thread's calls bound the run: the lookahead makes more of them per split.

Qwen3-30B-A3B's expert shapes in Q4_0: gate and up rows of 2048 elements, down rows of 768,
whose padded tail every fill clears. Timing-only backends: no bytes, full-size tensors.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

import expertstream
from expertstream.backends.base import HostBuffer, HostMemory
from expertstream.backends.sim import Access, KernelSpec, SimBackend, register_kernel
from expertstream.backends.sim.profiles import ProfileSpec
from expertstream.bench.predict import SLOT_CHOICES, Candidate, pick
from expertstream.ggml import row_size
from expertstream.hostmem import HostMemoryMode
from expertstream.scheduler import Input, MulMatId, Plan, Scheduler, Split
from expertstream.scheduler.source import HostRegion
from expertstream.timeline import OpKind

KERNEL = "es_test_timed_mul_mat_id"
N_EXPERT, TOP_K = 128, 8
SHAPES = (("gate", 768, 2048), ("up", 768, 2048), ("down", 2048, 768))  # rows, elements per row


def _accesses(args: tuple) -> list[Access]:
    weights, nbytes = args[0], int(args[1])
    padded_from = weights.offset + nbytes if nbytes < weights.nbytes else None
    return [Access(weights, write=False, padded_from=padded_from)]


register_kernel(KernelSpec(KERNEL, run=lambda args, grid, block: None, accesses=_accesses, flops=lambda a: float(a[2])))


def _device_of(layer: int, split: int, layers: int, devices: int, layout: str) -> int:
    if layout == "layers":  # llama.cpp's layer split: the first half of the layers on device 0
        return layer * devices // layers
    return (3 * layer + split) % devices  # splits alternate between the devices


@contextmanager
def _qwen3_plan(backend: SimBackend, host: HostMemory, tokens: int, layers: int, layout: str) -> Iterator[Plan]:
    n_ids = tokens * TOP_K
    splits, resources = [], []
    for layer in range(layers):
        for k, (name, rows, ne0) in enumerate(SHAPES):
            device = backend.device(_device_of(layer, k, layers, len(backend.devices), layout))
            ids = device.alloc(4 * n_ids)
            expert_nbytes = rows * row_size(Q.Q4_0, ne0)
            nbytes = N_EXPERT * expert_nbytes
            source: HostBuffer = device.placeholder_host(
                nbytes, HostMemory.PINNED if host is HostMemory.PINNED else host
            )
            resources += [ids, source]
            kernel = device.compile("", KERNEL)
            flops = 2.0 * n_ids * rows * ne0

            def compute(stream, bindings, kernel=kernel, nbytes=nbytes, flops=flops):  # type: ignore[no-untyped-def]
                stream.launch(kernel, 1, 1, (bindings["w"], np.int64(nbytes), np.float64(flops)))

            weights = Input(
                "w", nbytes, host=HostRegion(source, 0, nbytes), row_type=Q.Q4_0, ne0=ne0, expert_nbytes=expert_nbytes
            )
            routing = MulMatId(ids.view(), n_ids, N_EXPERT, ("w",))
            splits.append(Split(f"{name}.{layer}", device, (weights,), compute, routing))
    try:
        yield Plan.of(splits)
    finally:
        for resource in resources:
            resource.close()


def _run_ms(
    profile: ProfileSpec,
    devices: int,
    slots: int,
    host: HostMemory,
    tokens: int,
    layout: str = "layers",
    layers: int = 4,
) -> float:
    with expertstream.backend("sim", profile=profile, devices=devices, data=False) as backend:
        assert isinstance(backend, SimBackend)
        with _qwen3_plan(backend, host, tokens, layers, layout) as plan, Scheduler(slots=slots) as sched:
            start = backend.host_time()
            sched.run(plan)
            return (backend.host_time() - start) * 1e3


CASES = [(1, "layers"), (2, "layers"), (2, "alternate")]


@pytest.mark.parametrize("tokens", [512, 4096])
@pytest.mark.parametrize("host", [HostMemory.PINNED, HostMemory.PAGEABLE], ids=lambda h: h.value)
@pytest.mark.parametrize(("devices", "layout"), CASES, ids=[f"{d}dev-{layout}" for d, layout in CASES])
@pytest.mark.parametrize("profile", ["cuda-h200", "rocm-r9700"])
def test_more_slots_are_never_slower(profile: str, devices: int, layout: str, host: HostMemory, tokens: int) -> None:
    times = {slots: _run_ms(profile, devices, slots, host, tokens, layout) for slots in (0, 2, 3, 8)}
    ordered = list(times.values())
    assert all(later <= earlier for earlier, later in itertools.pairwise(ordered)), times
    assert times[2] < times[0], times  # and the lookahead pays at all


# The host pays nothing per call: what is left of a run is the devices' work and the order of it.
FREE_CALLS = {"enqueue_s": 0.0, "call_s": 0.0}
MANY = [(3, "layers"), (4, "layers"), (4, "alternate")]


@pytest.mark.parametrize("host", [HostMemory.PINNED, HostMemory.PAGEABLE], ids=lambda h: h.value)
@pytest.mark.parametrize(("devices", "layout"), MANY, ids=[f"{d}dev-{layout}" for d, layout in MANY])
@pytest.mark.parametrize("profile", ["cuda-h200", "rocm-r9700"])
def test_with_free_calls_more_slots_are_never_slower_on_three_and_four_devices(
    profile: str, devices: int, layout: str, host: HostMemory
) -> None:
    free_calls = {"base": profile, **FREE_CALLS}
    times = {slots: _run_ms(free_calls, devices, slots, host, 512, layout, layers=48) for slots in (0, 2, 3, 8)}
    ordered = list(times.values())
    assert all(later <= earlier for earlier, later in itertools.pairwise(ordered)), times
    assert times[2] < times[0], times


def test_the_launching_thread_s_calls_can_outweigh_the_lookahead_on_four_devices() -> None:
    """docs/design.md's case: 4 R9700s, 48 layers of 512 tokens split over them in order. One thread
    makes every device's calls, the lookahead more of them per split than the stock copy, so the
    devices whose layers come last start copying later. Free calls turn it round (the test above),
    and `--slots auto`, which predicts every count on the run's devices, keeps the stock path."""
    times = {slots: _run_ms("rocm-r9700", 4, slots, HostMemory.PINNED, 512, layers=48) for slots in SLOT_CHOICES}
    assert times[2] > times[0] and times[3] > times[0], times
    predicted = [Candidate(slots, HostMemoryMode.PINNED, 512, ms / 1e3) for slots, ms in times.items()]
    assert pick(predicted, free_bytes=1 << 40).slots == 0
    free_calls = {"base": "rocm-r9700", **FREE_CALLS}
    assert _run_ms(free_calls, 4, 2, HostMemory.PINNED, 512, layers=48) < _run_ms(
        free_calls, 4, 0, HostMemory.PINNED, 512, layers=48
    )


@pytest.mark.parametrize("profile", ["cuda-h200", "rocm-r9700"])
def test_pageable_sources_on_two_devices_copy_at_once(profile: str) -> None:
    with expertstream.backend("sim", profile=profile, devices=2, data=False) as backend:
        assert isinstance(backend, SimBackend)
        with (
            _qwen3_plan(backend, HostMemory.PAGEABLE, 512, layers=2, layout="alternate") as plan,
            Scheduler(slots=2) as sched,
        ):
            start = len(backend.timeline)
            sched.run(plan)
        copies = [op for op in backend.timeline[start:] if op.kind is OpKind.H2D]
    assert {op.device for op in copies} == {0, 1}
    overlapping = [
        (a, b)
        for a in copies
        for b in copies
        if a.device == 0 and b.device == 1 and a.start < b.end and b.start < a.end
    ]
    assert overlapping, "the two devices' copies took turns"


def test_a_decode_copy_s_ranges_are_calls_back_to_back() -> None:
    """A decode step copies its experts' ranges from a source that takes one range at a time in a
    loop with nothing of the job between the calls: each costs the profile's call_s, not enqueue_s."""
    from expertstream.scheduler.source import enqueue_ranges

    profile = {"base": "cuda-h200", "enqueue_s": 1e-3, "call_s": 1e-6, "pageable_blocks_host": False}
    with expertstream.backend("sim", profile=profile) as sim:
        device = sim.device(0)
        host = device.wrap_host(np.zeros(1 << 16, dtype=np.uint8))
        with device.stream() as stream, device.alloc(1 << 16) as dst:
            start = sim.host_time()
            enqueue_ranges(HostRegion(host, 0, 1 << 16), stream, dst, [(i * 4096, i * 4096 + 100) for i in range(10)])
            took = sim.host_time() - start
            stream.synchronize()
    assert took == pytest.approx(10 * 1e-6)  # ten calls alone, not ten of the job's
